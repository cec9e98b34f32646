"""The variants' options of ``mha-rosetta diagnose`` (``core.VARIANTS``; each off by default).

``add_variant_arguments`` adds them in a group of their own; ``with_variants(cfg, args)`` returns the
configuration with the variants given switched on (`MHAConfig` validates each and names the field).
They describe the configuration as the size options do, so ``--like`` (which reads the whole
configuration from a real module) refuses them.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

# option dest -> the MHAConfig field it sets
FIELDS = {
    "window": "window",
    "softcap": "softcap",
    "qk_norm": "qk_norm",
    "norm_eps": "norm_eps",
    "alibi": "alibi",
    "sinks": "sinks",
    "rel_buckets": "rel_buckets",
    "rel_max_distance": "rel_max_distance",
    "rope_scaling": "rope_scaling",
}


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(
            f'expected a JSON object in Hugging Face\'s form, e.g. \'{{"rope_type": "linear", "factor": 2.0}}\'; '
            f"got {text!r} ({error.msg})"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object (a dict), got {text!r}")
    return value


def add_variant_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("variants (each off by default; the formulas in mha_rosetta.core.variants)")
    group.add_argument("--window", type=int, help="sliding window of W keys, the query's own included")
    group.add_argument("--softcap", type=float, help="logit softcap c: scores become c * tanh(s / c)")
    group.add_argument("--qk-norm", choices=("head", "projection"), help="RMSNorm of q and k: per head or projection")
    group.add_argument("--norm-eps", type=float, help="the QK-norm's epsilon (default 1e-6)")
    group.add_argument("--qkv-bias", action="store_true", help="q, k and v biased, the output not (Qwen2)")
    group.add_argument("--alibi", action="store_true", help="ALiBi: m_h (p_j - p_i) added to the scores")
    group.add_argument("--sinks", action="store_true", help="one learned logit per head in the softmax denominator")
    group.add_argument("--rel-buckets", type=int, help="T5's relative position buckets (params.rel_bias)")
    group.add_argument("--rel-max-distance", type=int, help="T5's max distance (default 128)")
    group.add_argument("--rel-decoder", action="store_true", help="T5's decoder buckets: past keys only")
    group.add_argument(
        "--rope-scaling",
        type=_json_object,
        metavar="JSON",
        help='rope_scaling in Hugging Face\'s form, e.g. \'{"rope_type": "linear", "factor": 2.0}\' (needs --rope)',
    )


def given(args: argparse.Namespace) -> list[str]:
    """The variant options given on the command line, as typed."""
    names = [*FIELDS, "qkv_bias", "rel_decoder"]
    return ["--" + name.replace("_", "-") for name in names if _given(getattr(args, name, None))]


def _given(value) -> bool:
    """An option given: not its default None or False (0 is given: `MHAConfig` then says why it is wrong)."""
    return value is not None and value is not False


def with_variants(cfg, args: argparse.Namespace):
    """``cfg`` with the variant options switched on; ValueError for a combination that contradicts itself."""
    options = given(args)
    if not options:
        return cfg
    if getattr(args, "like", None):
        raise ValueError(f"--like gives the whole configuration; drop {', '.join(options)}")
    if args.qkv_bias and getattr(args, "no_bias", False):
        raise ValueError("--qkv-bias (q, k and v biased) contradicts --no-bias: give one")
    for option, needs, present in (
        ("--rel-decoder", "--rel-buckets", args.rel_buckets),
        ("--rel-max-distance", "--rel-buckets", args.rel_buckets),
        ("--norm-eps", "--qk-norm", args.qk_norm),
    ):
        if option in options and present is None:
            raise ValueError(f"{option} needs {needs} (it sets a part of that variant)")
    fields = {field: getattr(args, dest) for dest, field in FIELDS.items() if _given(getattr(args, dest))}
    if args.qkv_bias:
        fields["bias"] = "qkv"
    if args.rel_decoder:
        fields["rel_bidirectional"] = False
    return replace(cfg, **fields)

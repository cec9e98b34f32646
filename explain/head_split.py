"""Which (token, feature) cells of the projected Q each head receives: the right split and the mistake.

The assignment is not drawn by hand: every cell of a ``(tokens, H*Dk)`` matrix gets
its own number, the real reshape/transpose chain is applied to those numbers, and
each head's block is read back to see which cells landed in it.

- correct: ``(N, H*Dk) -> (N, H, Dk) -> (H, N, Dk)``: head h gets every token, with
  feature columns ``h*Dk:(h+1)*Dk``;
- mistake: ``(N, H*Dk) -> (H, N, Dk)`` in one reshape: head h gets the cells that
  follow each other in memory, i.e. a run of whole tokens with all their features.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

import numpy as np

HEAD_LETTERS = string.ascii_uppercase + string.ascii_lowercase + string.digits
# Distinct colours for heads (rich colour names and matching matplotlib hex codes).
RICH_COLOURS = ("red", "green", "blue", "magenta", "cyan", "yellow", "bright_red", "bright_green", "bright_blue")
PLOT_COLOURS = ("#e45756", "#54a24b", "#4c78a8", "#b279a2", "#72b7b2", "#eeca3b", "#ff9da6", "#9d755d", "#bab0ac")


# How the text, the rich panels and the picture name each split.
SPLIT_LABELS = {"correct": "correct split", "direct_reshape": "direct-reshape mistake"}


def head_letter(head: int) -> str:
    return HEAD_LETTERS[head % len(HEAD_LETTERS)]


@dataclass(frozen=True)
class HeadSplit:
    """One way of splitting ``(tokens, H*Dk)`` into heads, read off real index arrays."""

    name: str
    chain: str  # the operations, with shapes
    heads: np.ndarray  # (H, N, Dk): the cell number each head holds at each place
    owner: np.ndarray  # (N, H*Dk): which head received each cell
    row_in_head: np.ndarray  # (N, H*Dk): at which row of its head's (N, Dk) block the cell landed

    @property
    def n_heads(self) -> int:
        return self.heads.shape[0]

    def tokens_of(self, head: int) -> list[int]:
        """The tokens (rows of Q) whose cells head ``head`` received."""
        width = self.owner.shape[1]
        return sorted({int(cell) // width for cell in self.heads[head].ravel()})

    def features_of(self, head: int) -> list[int]:
        """The feature columns of Q whose cells head ``head`` received."""
        width = self.owner.shape[1]
        return sorted({int(cell) % width for cell in self.heads[head].ravel()})

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "chain": self.chain,
            "owner": self.owner.tolist(),
            "row_in_head": self.row_in_head.tolist(),
            "heads": [
                {"head": h, "tokens": self.tokens_of(h), "features": self.features_of(h)} for h in range(self.n_heads)
            ],
        }


def _read_back(name: str, chain: str, heads: np.ndarray) -> HeadSplit:
    n_heads, n_tokens, d_k = heads.shape  # (H, N, Dk)
    width = n_heads * d_k
    owner = np.full(n_tokens * width, -1)
    row_in_head = np.full(n_tokens * width, -1)
    for h in range(n_heads):
        for row in range(n_tokens):
            owner[heads[h, row]] = h
            row_in_head[heads[h, row]] = row
    return HeadSplit(name, chain, heads, owner.reshape(n_tokens, width), row_in_head.reshape(n_tokens, width))


def head_splits(n_tokens: int, n_heads: int, d_k: int) -> dict[str, HeadSplit]:
    """The correct split and the direct-reshape mistake, applied to numbered cells."""
    for name, value in (("n_tokens", n_tokens), ("n_heads", n_heads), ("d_k", d_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    width = n_heads * d_k
    cells = np.arange(n_tokens * width).reshape(n_tokens, width)  # (N, H*Dk): cell number t*H*Dk + f
    correct = cells.reshape(n_tokens, n_heads, d_k).transpose(1, 0, 2)  # (N, H, Dk) -> (H, N, Dk)
    mistake = cells.reshape(n_heads, n_tokens, d_k)  # (H, N, Dk) straight from memory order
    return {
        "correct": _read_back(
            "correct",
            f"({n_tokens}, {width}) -> ({n_tokens}, {n_heads}, {d_k}) -> ({n_heads}, {n_tokens}, {d_k})",
            correct,
        ),
        "direct_reshape": _read_back(
            "direct_reshape",
            f"({n_tokens}, {width}) -> ({n_heads}, {n_tokens}, {d_k}) in one reshape",
            mistake,
        ),
    }


def head_summary(split: HeadSplit) -> list[str]:
    """One line per head: which tokens and which features it sees."""
    lines = []
    n_tokens, width = split.owner.shape
    for h in range(split.n_heads):
        tokens, features = split.tokens_of(h), split.features_of(h)
        token_text = "all tokens" if len(tokens) == n_tokens else f"tokens {_ranges(tokens)} only"
        feature_text = "all features" if len(features) == width else f"features {_ranges(features)}"
        lines.append(f"head {h} ({head_letter(h)}): {token_text}, {feature_text}")
    return lines


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    parts, start = [], None
    for i, value in enumerate(values):
        if start is None:
            start = value
        if i + 1 == len(values) or values[i + 1] != value + 1:
            parts.append(str(start) if start == value else f"{start}-{value}")
            start = None
    return ", ".join(parts)


def grid_text(split: HeadSplit, colour: bool = False, width: int | None = None) -> str:
    """The (token x feature) grid, each cell marked with the letter of the head that got it.

    With ``colour=True`` the letters carry rich markup (one colour per head). A grid wider than
    ``width`` (None: no limit) is split into parts of columns, each repeating the token labels.
    """
    n_tokens, n_features = split.owner.shape
    label_width = len(f"token {n_tokens - 1}")
    pad = " " * (label_width + 1)
    legend = "   <- feature (column of Q)"
    # Each column costs two characters (letter and space); the legend stays on every part's units line.
    per_part = n_features if width is None else max(1, (width - label_width - len(legend)) // 2)
    lines = []
    for start in range(0, n_features, per_part):
        features = range(start, min(start + per_part, n_features))
        if lines:
            lines.append("")
        if n_features > 10:  # a tens line above the units line keeps one character per column
            lines.append(pad + " ".join(str(f // 10) if f >= 10 else " " for f in features))
        lines.append(pad + " ".join(f"{f % 10}" for f in features) + legend)
        for t in range(n_tokens):
            marks = []
            for f in features:
                h = int(split.owner[t, f])
                letter = head_letter(h)
                marks.append(f"[bold {RICH_COLOURS[h % len(RICH_COLOURS)]}]{letter}[/]" if colour else letter)
            lines.append(f"{f'token {t}':<{label_width}} " + " ".join(marks))
    return "\n".join(lines)


def pyplot(picture: str):
    """``matplotlib.pyplot`` on the Agg backend, or an ImportError that says which ``picture`` needs it."""
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError(f"the {picture} needs matplotlib: pip install 'mha-rosetta[bench]'") from error
    matplotlib.use("Agg")  # no screen needed, and no window pops up
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure, path) -> str:
    """Lay out, write (110 dpi) and close ``figure``; returns the path."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return str(path)


def save_png(splits: dict[str, HeadSplit], path, title: str = "") -> str:
    """Draw both splits side by side as a PNG (matplotlib, Agg backend). Returns the path."""
    plt = pyplot("head-split picture")
    from matplotlib.colors import ListedColormap

    first = next(iter(splits.values()))
    n_tokens, width = first.owner.shape
    n_heads = first.n_heads
    colours = ListedColormap([PLOT_COLOURS[h % len(PLOT_COLOURS)] for h in range(n_heads)])
    figure, axes = plt.subplots(
        1, len(splits), figsize=(max(6, 0.5 * width) * len(splits), max(3, 0.5 * n_tokens) + 1.5)
    )
    for ax, split in zip(np.atleast_1d(axes), splits.values(), strict=True):
        ax.imshow(split.owner, cmap=colours, vmin=-0.5, vmax=n_heads - 0.5, aspect="equal")
        if n_tokens * width <= 600:  # letters stay readable only on small grids
            for t in range(n_tokens):
                for f in range(width):
                    h = int(split.owner[t, f])
                    ax.text(
                        f,
                        t,
                        f"{head_letter(h)}{int(split.row_in_head[t, f])}",
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white",
                    )
        ax.set_title(f"{SPLIT_LABELS.get(split.name, split.name)}\n{split.chain}", fontsize=9)
        ax.set_xlabel("feature (column of Q = X @ W_B)")
        ax.set_ylabel("token")
        ax.set_xticks(range(width))
        ax.set_yticks(range(n_tokens))
        for boundary in range(1, n_heads):  # the head boundaries of the correct split
            ax.axvline(boundary * (width // n_heads) - 0.5, color="black", linewidth=0.8, linestyle=":")
    figure.suptitle(
        title or "Which head receives each (token, feature) cell; label = head letter + row in that head's block",
        fontsize=10,
    )
    return save_figure(figure, path)

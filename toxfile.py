"""tox's inline plugin: in CI, each environment's virtualenv is deleted once its commands have run.

`tox` runs eleven environments one after another, and each keeps its own virtualenv: torch,
JAX, transformers and keras several times over, about 9 GB in all when the last one starts
(`all` alone is 2.2 GB). CI's disk is not ours to size: a run on 2026-12-01 failed in its
tenth environment with "No space left on device" after the first nine had passed. With
`MHA_ROSETTA_TOX_DISCARD_ENVS=1` (set by `.ci/run`), an environment's virtualenv and temporary
folder go as soon as it is done, so the disk holds one environment at a time. Its log folder
stays, and so does the shared packaging environment (`.pkg`), which later environments reuse.
Without the variable nothing is deleted: a developer's `tox` keeps its environments for reuse.
"""

from __future__ import annotations

import os
import shutil

from tox.plugin import impl
from tox.tox_env.api import ToxEnv
from tox.tox_env.runner import RunToxEnv

SWITCH = "MHA_ROSETTA_TOX_DISCARD_ENVS"


@impl
def tox_env_teardown(tox_env: ToxEnv) -> None:
    if os.environ.get(SWITCH) != "1" or not isinstance(tox_env, RunToxEnv):
        return
    env_dir = tox_env.env_dir
    keep = tox_env.env_log_dir
    if not env_dir.is_dir():
        return
    for entry in env_dir.iterdir():
        if entry == keep:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)

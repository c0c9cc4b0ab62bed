"""``model.source`` checked without the model stack in this process: the checkpoint is validated (and the default
one written on first use) by :func:`~relax_services.models.open_checkpoint` in a child Python process, whose
verdict comes back as JSON.

The driver (the ``relax train`` process) uses this so that it never imports torch or transformers (≈ 0.6 GB of
its memory, and seconds of its start-up): what it needs of a checkpoint is that it is valid and where its folder
is. A process that has imported transformers already (the colocated mode, tests) validates in process instead.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

from relax_services.models._light import CheckpointError, CheckpointNotFoundError

__all__ = ["check_source", "linear_layer_names"]

_ERRORS: dict[str, type[CheckpointError]] = {"not_found": CheckpointNotFoundError, "invalid": CheckpointError}
"""The child's error kind → the error raised here (an unsupported architecture is an invalid checkpoint)."""


def check_source(source: str | Path, seed: int = 0, *, in_process: bool = False) -> Path:
    """The validated checkpoint folder of ``model.source`` (``"tiny-omni"``: the default one, written first when
    missing), checked once per process and source.

    Args:
        source: ``model.source``.
        seed: ``model.seed`` (the default checkpoint's initial weights).
        in_process: Validate here, importing the model stack, instead of in a child process: for a process that
            imports it anyway (the colocated mode), where the child would only add an interpreter's start and a
            second import of torch and transformers.

    Raises:
        CheckpointNotFoundError: The folder or its ``config.json`` does not exist.
        CheckpointError: Anything else :func:`~relax_services.models.validate_checkpoint` rejects (the message
            names the path and the problem).
    """
    return _check(str(source), int(seed), in_process)


@functools.cache
def _check(source: str, seed: int, in_process: bool) -> Path:
    if in_process or "transformers" in sys.modules:  # the model stack is (or will be) here: no child to pay for
        return _answer(_main(source, seed))
    return _answer(_in_child(source, seed))


def linear_layer_names(source: str | Path, seed: int = 0, *, in_process: bool = False) -> list[str]:
    """:func:`check_source`, and the own names of the linear layers of ``model.source``'s model (what
    ``model.lora.target_modules`` may name), read from a model built on the meta device (no weights), in one child
    process unless ``in_process``.

    Raises:
        CheckpointError: As :func:`check_source`.
    """
    if in_process or "transformers" in sys.modules:
        verdict = _linear_names(str(source), int(seed))
    else:
        verdict = _in_child(str(source), int(seed), "--linear-names")
    _answer(verdict)
    return json.loads(verdict["linear_names"])  # type: ignore[no-any-return]


def _in_child(source: str, seed: int, *flags: str) -> dict[str, str]:
    out = subprocess.run(
        [sys.executable, "-m", "relax_services.models.source_check", *flags, source, str(seed)],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"checking model.source={source!r} failed in its child process:\n{out.stderr[-3000:]}")
    verdict: dict[str, str] = json.loads(lines[-1])
    return verdict


def _answer(verdict: dict[str, str]) -> Path:
    if "path" in verdict:
        return Path(verdict["path"])
    raise _ERRORS[verdict["error"]](verdict["message"])


def _main(source: str, seed: int) -> dict[str, str]:
    from relax_services.models import CheckpointNotFoundError, UnsupportedArchitectureError, open_checkpoint

    try:
        return {"path": str(open_checkpoint(source, seed).path)}
    except CheckpointNotFoundError as exc:
        return {"error": "not_found", "message": str(exc)}
    except (CheckpointError, UnsupportedArchitectureError) as exc:
        return {"error": "invalid", "message": str(exc)}


def _linear_names(source: str, seed: int) -> dict[str, str]:
    verdict = _main(source, seed)
    if "path" not in verdict:
        return verdict
    from relax_services.config import ModelConfig
    from relax_services.models.lora import linear_names
    from relax_services.models.policy import empty_policy

    names = linear_names(empty_policy(ModelConfig(source=source, seed=seed)))
    return {**verdict, "linear_names": json.dumps(names)}


if __name__ == "__main__":
    if sys.argv[1] == "--linear-names":
        print(json.dumps(_linear_names(sys.argv[2], int(sys.argv[3]))), flush=True)
    else:
        print(json.dumps(_main(sys.argv[1], int(sys.argv[2]))), flush=True)

"""All ranks agree on the config before they build anything (one meeting, right after the process group starts).

Ranks with different configs would build different meshes or units and die in a collective (a gloo abort,
or a hang); a config, model or loader error on one rank only would leave the others waiting. Both become
the same ``ValueError`` on every rank, naming the fields or the rank.
"""

import hashlib
import json
import uuid
from typing import Any

from ..config import Config
from ..config._io import fmt
from ..distributed import env
from ..distributed.collectives import all_gather_object

__all__ = ["agree_on_config", "report_config_error"]


def agree_on_config(config: Config, error: Exception | None) -> str:
    """Meet every rank once, before any other collective, and raise the same error everywhere when the ranks
    disagree on the config or one of them found it invalid; the same meeting hands every rank rank 0's run id.

    Ranks with different configs would build different meshes or units and die in a collective (a gloo
    abort, or a hang); a config error on one rank only would leave the others waiting. Every rank must call
    it, after ``env.init_distributed``; it does nothing in a world of one.

    Args:
        config: this rank's config.
        error: the error this rank's validation raised, or None.

    Returns:
        The run id of the accelerated model (see [Note: shard metadata]): a fresh hex string, rank 0's on every rank.

    Raises:
        ValueError: naming the fields that differ (with each rank's value), or another rank's error.
    """
    run_id = uuid.uuid4().hex
    if not env.is_distributed():
        return run_id
    flat = _flatten(config.to_dict())
    digest = hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()
    reports = all_gather_object((digest, None if error is None else f"{type(error).__name__}: {error}", run_id))
    if len({d for d, _, _ in reports}) > 1:
        configs = all_gather_object(flat)
        differing = sorted(k for k in set().union(*configs) if len({repr(c.get(k)) for c in configs}) > 1)
        details = "; ".join(
            f"{key}: " + ", ".join(f"rank {r}={fmt(c.get(key))}" for r, c in enumerate(configs)) for key in differing
        )
        raise ValueError(
            f"the ranks were given different configs ({details}); every rank must build the same torchacc.Config: "
            "set these fields outside any rank-dependent branch"
        )
    failed = [(rank, message) for rank, (_, message, _) in enumerate(reports) if message]
    if failed and error is None:
        rank, message = failed[0]
        raise ValueError(f"rank {rank} stopped at its checks before any collective: {message}")
    return reports[0][2]


def report_config_error(config: Config, error: Exception) -> None:
    """Share an error this rank's checks raised (config, model, loader) with the others before raising it.

    With a config that differs between ranks, the other ranks may not have failed and would wait for this
    one. Call it only in a job of several ranks; it returns when there is no process group to share through.

    Raises:
        ValueError: the ranks' configs differ (naming the fields).
    """
    try:
        env.init_distributed()
    except (ValueError, RuntimeError):
        return  # the launch itself is broken: the caller reports its own error
    agree_on_config(config, error)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat

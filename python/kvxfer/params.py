"""Reading ``kv_transfer_params`` as the vLLM connector writes them, without vLLM: the
router (``kvxfer.proxy``) releases hand-offs with these, the connector pulls them."""

from __future__ import annotations

from typing import Any


def rank_view(params: dict[str, Any], rank: int) -> dict[str, Any]:
    """A hand-off's params as prefill rank ``rank`` serves it (its address and incarnation,
    from the ``kvxfer_rank_*`` lists)."""
    if rank == 0:
        return params
    out = dict(params)
    for key, field in (
        ("kvxfer_rank_hosts", "remote_host"),
        ("kvxfer_rank_ports", "remote_port"),
        ("kvxfer_rank_incarnations", "kvxfer_incarnation"),
    ):
        values = params.get(key)
        if isinstance(values, list) and rank < len(values):
            out[field] = values[rank]
    return out


def handoff_entries(params: Any) -> list[dict[str, Any]]:
    """Every kvxfer hand-off ``params`` names (each child's of ``kvxfer_children``, the
    entries of vLLM's list form, or the dict itself), without the sibling list; entries
    that are not kvxfer hand-offs (no lease token) are left out."""
    if isinstance(params, dict):
        children = params.get("kvxfer_children")
        entries = children if isinstance(children, list) and children else [params]
    elif isinstance(params, list):
        entries = params
    else:
        return []
    return [
        {k: v for k, v in e.items() if k != "kvxfer_children"}
        for e in entries
        if isinstance(e, dict) and e.get("do_remote_prefill") and e.get("kvxfer_lease_token")
    ]


def every_rank(params: dict[str, Any]) -> list[dict[str, Any]]:
    """One hand-off's params as each prefill rank serves it: ``tp_size`` ranks, at most as
    many as ``kvxfer_rank_ports`` lists (a rank without an address of its own cannot be
    reached; one when ``tp_size`` is missing or not a positive int)."""
    size = params.get("tp_size")
    ranks = size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else 1
    ports = params.get("kvxfer_rank_ports")
    ranks = min(ranks, len(ports)) if isinstance(ports, list) and ports else 1
    return [rank_view(params, r) for r in range(ranks)]

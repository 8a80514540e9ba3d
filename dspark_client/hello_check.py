"""Whether a worker fits this engine: what an accepted HELLO's reply must say, and what a
refusal for the limits may be about (docs/contract.md 6.1, 6.4, 6.5). Pure: the link calls these
on every HELLO reply and disables remote drafting with their words when they find anything.
"""

from __future__ import annotations

from protocol import wire

__all__ = ["limits_hint", "reply_problems"]


def reply_problems(ours: wire.Hello, rep: wire.HelloReply) -> list[str]:
    """Every way ``rep`` does not match the HELLO ``ours`` (empty: it fits). A following
    session (HF_FOLLOW) takes any drafter of its geometry: the reply says which."""
    follows = bool(ours.flags & wire.HF_FOLLOW)
    problems = []
    if rep.version != ours.version:
        problems.append(f"version {rep.version} != {ours.version}")
    if not follows and rep.drafter_identity != ours.drafter_identity:
        problems.append(f"drafter identity {rep.drafter_identity.hex()[:16]}.. !="
                        f" ours {ours.drafter_identity.hex()[:16]}..")
    if not follows and rep.markov_identity != ours.markov_identity:
        problems.append(f"markov identity {rep.markov_identity.hex()[:16]}.. !="
                        f" ours {ours.markov_identity.hex()[:16]}..")
    for field in ("window", "num_spec", "row_bytes", "vocab_size", "n_taps", "hidden"):
        theirs, mine = getattr(rep, field), getattr(ours, field)
        if theirs != mine:
            problems.append(f"{field} {theirs} != ours {mine}")
    if ours.sample_mode == wire.SAMPLE_TOP32 and not rep.capabilities & wire.CAP_TOP32:
        problems.append("worker lacks the dyadic24 top32 capability")
    if not rep.capabilities & wire.CAP_TAPS_BF16:
        problems.append("worker lacks the TAPS_BF16 capability")
    if rep.max_slots < ours.max_slots:
        problems.append(f"max_slots {rep.max_slots} < ours {ours.max_slots}")
    if rep.max_rows_per_step < ours.max_rows_per_step:
        problems.append(f"max_rows_per_step {rep.max_rows_per_step} < ours"
                        f" {ours.max_rows_per_step}")
    return problems


def limits_hint(ours: wire.Hello) -> str:
    """What ST_LIMITS may be about beyond the HelloReply's fields: the frame limit."""
    body = wire.rows_offset_for(ours.max_slots) + ours.max_rows_per_step * ours.row_bytes
    return (f"; this engine's largest STEP is {wire.APP_HEADER_SIZE + body} bytes"
            f" (max_slots {ours.max_slots}, max_rows_per_step {ours.max_rows_per_step},"
            f" {ours.row_bytes}-byte rows): raise the worker's --max-frame-bytes or lower"
            " max_rows_per_step")

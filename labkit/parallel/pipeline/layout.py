"""Where the model's pieces sit: which stage and chunk holds the piece before or after a stage's chunk.

With v chunks per stage the model is cut into v p pieces. Looped (GPipe, 1F1B, ZB-H1, interleaved 1F1B:
Narayanan et al. 2021, section 2.2.2): stage r's chunk c is piece c p + r, so a micro-batch passes the stages v
times in the same direction, the last stage handing on to the first. V-shaped (DualPipeV,
github.com/deepseek-ai/DualPipe: DualPipe of DeepSeek-AI 2024, arXiv:2412.19437, section 3.2.1, cut in half;
torch's generate_stage_to_rank_mapping(style="v")): two chunks, stage r holding
pieces r and 2p-1-r, so a micro-batch goes down the stages and back up, the last stage handing on to itself, and
stage 0 holds the model's first and last pieces.
"""

from __future__ import annotations

__all__ = ["V_SHAPED", "piece", "piece_after", "piece_before"]

V_SHAPED = ("dualpipe-v",)  # the kinds whose two chunks per stage lie as a V


def piece(kind: str, stage: int, chunk: int, stages: int) -> int:
    """The model piece (0 first) that `stage`'s `chunk` holds."""
    if kind in V_SHAPED:
        return stage if chunk == 0 else 2 * stages - 1 - stage
    return chunk * stages + stage


def _holder(kind: str, k: int, stages: int, chunks: int) -> tuple[int, int] | None:
    """The (stage, chunk) holding piece k (None: no such piece)."""
    if not 0 <= k < stages * chunks:
        return None
    if kind in V_SHAPED:
        return (k, 0) if k < stages else (2 * stages - 1 - k, 1)
    return k % stages, k // stages


def piece_after(kind: str, stage: int, chunk: int, stages: int, chunks: int) -> tuple[int, int] | None:
    """The (stage, chunk) of the piece after `stage`'s `chunk` (None: it is the model's last)."""
    return _holder(kind, piece(kind, stage, chunk, stages) + 1, stages, chunks)


def piece_before(kind: str, stage: int, chunk: int, stages: int, chunks: int) -> tuple[int, int] | None:
    """The (stage, chunk) of the piece before `stage`'s `chunk` (None: it is the model's first)."""
    return _holder(kind, piece(kind, stage, chunk, stages) - 1, stages, chunks)

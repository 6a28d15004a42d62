"""The live viewer's memory bounds (rollout_service/viewer/live.py): the full results it keeps for the
group pages are bounded by the tokens they hold, not only by their count.

A stand-in for the service: LiveBook.record reads only `service.envs.task_info`, and groups of a
million token ids are what a real run makes but what the CPU model of the tests cannot make in a
test's time. The groups are real GroupResult records, as the service hands them to on_result.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from test_viewer_runlog import _group

from rollout_service.protocol import GroupResult
from rollout_service.viewer.live import GROUPS_KEPT, TOKENS_KEPT, LiveBook

TURN = {
    "index": 0,
    "stage": "solve",
    "trainable": True,
    "model": "m",
    "endpoint": "chat",
    "messages": [{"role": "user", "content": "hi"}],
    "completion": "ok",
    "token_source": "server",
    "prompt_tokens": 0,
    "completion_tokens": 0,
}


def _big(group_id: str, prompt_ids: int) -> tuple[GroupResult, int]:
    """A chat-mode group of 2 attempts x 4 turns, each turn with `prompt_ids` prompt ids and 100 sampled
    tokens; and the token ids and logprobs it holds, counted here from what was written."""
    g = _group(group_id, [0.0, 1.0])
    held = 0
    for attempt in g["attempts"]:
        attempt["turns"] = [
            dict(
                TURN,
                index=i,
                prompt_token_ids=list(range(prompt_ids)),
                completion_token_ids=[7] * 100,
                logprobs=[-0.5] * 100,
            )
            for i in range(4)
        ]
        held += 4 * (prompt_ids + 200)
    return GroupResult.model_validate_json(json.dumps(g)), held


def _book() -> LiveBook:
    return LiveBook(SimpleNamespace(envs=SimpleNamespace(task_info={})))  # type: ignore[arg-type]


def test_large_groups_are_kept_by_the_tokens_they_hold():
    """Groups of ~160k token ids each: the book keeps the newest ones whose tokens fit TOKENS_KEPT (and
    always the newest, however large), the list still has them all, an evicted group's page is None.
    Break tried: record() bounded by GROUPS_KEPT alone (as it was) -> fails: 40 groups kept, 6.5M tokens."""
    book = _book()
    sizes = []
    for i in range(40):
        result, held = _big(f"g{i}", 20_000)
        sizes.append(held)
        book.record(result)
    kept = list(book.results)
    assert kept == list(range(40 - len(kept), 40)) and kept, kept  # the newest, in order
    assert sum(sizes[s] for s in kept) <= TOKENS_KEPT
    assert sum(sizes[s] for s in [kept[0] - 1, *kept]) > TOKENS_KEPT  # none evicted that would have fit
    assert len(book.summaries) == 40

    # One group larger than the whole budget is still kept (it is the newest), alone.
    huge, held = _big("huge", TOKENS_KEPT // 8)
    assert held > TOKENS_KEPT
    book.record(huge)
    assert list(book.results) == [40]


def test_small_groups_are_kept_by_count():
    """Small groups: the newest GROUPS_KEPT of them, the older ones' pages gone.
    Break tried: the count bound dropped from record()'s loop -> fails: every group kept."""
    book = _book()
    small = GroupResult.model_validate_json(json.dumps(_group("s", [0.0, 1.0])))
    for _ in range(GROUPS_KEPT + 50):
        book.record(small)
    assert list(book.results) == list(range(50, GROUPS_KEPT + 50))
    assert asyncio.run(book.group(49)) is None and asyncio.run(book.group(50)) is small

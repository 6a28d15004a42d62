"""A model server's chat template, asked through its /tokenize: the renders a trajectory is made of.

Probed once per model route: whether the server takes token prompts at all, what the template puts
after an assistant message's content (the end of turn), and whether the template's render of new
messages after an assistant turn can be read apart (for templates that render history otherwise
than the model saw it; server/groups/trajectory.py says how each is used).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from functools import partial

from .answers import TokenizeAnswer
from .errors import BadInferenceResponse, InferenceError, InferenceRejected
from .json_body import JsonList
from .replica_pool import ReplicaPool

# A tiny conversation whose render shows what the template puts after an assistant's content.
_PROBE_USER = {"role": "user", "content": "a"}
_PROBE_REPLY = "b"
_PROBE_ANCHOR = [_PROBE_USER, {"role": "assistant", "content": _PROBE_REPLY}]
# The anchor again with another one-token reply: where its render differs from the anchor's is the
# reply's place, whatever the new messages hold (a "b" of their own, say).
_PROBE_ANCHOR_OTHER = [_PROBE_USER, {"role": "assistant", "content": "d"}]
_PROBE_NEXT = {"role": "user", "content": "c"}
_DECAY = 0.97  # _Odds: a try weighs about as much as the ~30 before it in all
# Openings kept at most: more groups at once than this re-render theirs now and then.
_MAX_OPENINGS = 8192
# A segment's opening render: its ids (their JSON written once for the group's attempts), and the
# same as vLLM's JSON array where the answer had its shape.
Opening = tuple[JsonList, bytes | None]
# Answers that say for good that the server cannot do it (no such route, a template it cannot
# apply, not implemented); anything else (429, 401, 5xx, no answer) may pass and is asked again.
_DEFINITIVE = (400, 404, 405, 422, 501)


class TokenPromptsUnsupported(InferenceRejected):
    """The model server cannot take this service's token prompts (no /tokenize, or a chat template
    whose render of an assistant message this service cannot split)."""

    kind = "inference_rejected"


@dataclass
class _Odds:
    """Whether a guess that costs a request is worth asking: while it held in at least one try in
    four lately (a decaying count), and, when it did not, again once in 16 turns to see a change."""

    tries: float = 0.0
    held: float = 0.0
    skipped: int = 0

    def worth_asking(self) -> bool:
        if self.tries < 8 or self.held * 4 >= self.tries:
            return True
        self.skipped += 1
        return self.skipped % 16 == 0

    def saw(self, held: bool) -> None:
        self.tries = self.tries * _DECAY + 1
        self.held = self.held * _DECAY + held


@dataclass
class TemplateRenderer:
    """Renders conversations to token ids with a model server's own chat template (/tokenize).

    `end_of_turn` is what the template appends after an assistant message's content (`<|im_end|>\\n`
    for ChatML), learnt once by rendering a probe conversation; a completion that stopped on the
    first of those tokens has already sampled it. It is None for a template that renders the last
    assistant message apart from the generation prompt and content (a reasoning template): its
    segments are always `appended`."""

    client: ReplicaPool
    model: str
    end_of_turn: list[int] | None = None
    # Whether the template's render of new messages after an assistant turn can be read apart
    # (`new_part`): set by the probe; `_anchor_ids` is the reply's place in that render.
    appends: bool = False
    unsupported: str | None = None  # why token prompts cannot be used, once known
    # What every render of the anchor followed by new messages must begin with: the render of the
    # anchor's first message as it opens the first prompt (a template that moves a new message before
    # it, as R1's hoists a system message, renders no continuation).
    _anchor_head: list[int] = field(default_factory=list)
    _probe_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # How often a reply tokenized alone is what the template makes of it in place (_continuation's 2).
    replies_alone: _Odds = field(default_factory=_Odds)
    # Per group (its affinity): the messages its last segment opened on and their render, in flight or
    # done. A group's n attempts mostly open on the same messages, rendered once for all of them.
    _openings: dict[str, tuple[list[dict], asyncio.Future[Opening]]] = field(default_factory=dict)

    async def supported(self, affinity: str | None = None) -> bool:
        """Whether the server takes token prompts; probes once. Transport failures raise (and are not
        remembered: the next attempt probes again)."""
        if self.end_of_turn is not None or self.appends or self.unsupported is not None:
            return self.unsupported is None
        async with self._probe_lock:
            if self.end_of_turn is None and not self.appends and self.unsupported is None:
                await self._probe(affinity)
        return self.unsupported is None

    async def _probe(self, affinity: str | None) -> None:
        try:
            prompt, whole, reply, following = await asyncio.gather(
                self.render([_PROBE_USER], True, affinity),
                self.render(_PROBE_ANCHOR, False, affinity),
                self.tokens_of(_PROBE_REPLY, affinity),
                self.render([*_PROBE_ANCHOR, _PROBE_NEXT], True, affinity),
            )
            # The completions route must take the ids and give back ids and logprobs.
            answer = await self.client.complete(
                model=self.model, prompt_token_ids=prompt, sampling={"max_tokens": 1, "temperature": 0.0}
            )
        except InferenceError as exc:
            if isinstance(exc, BadInferenceResponse) or exc.status in _DEFINITIVE:
                self.unsupported = f"{exc.kind} {exc.status or ''}: {exc.detail}"
                return
            raise
        choice = answer.choices[0]
        if (
            not choice.completion_token_ids
            or choice.logprobs is None
            or len(choice.logprobs) != len(choice.completion_token_ids)
        ):
            self.unsupported = "its /v1/completions does not return the token ids and logprobs"
            return
        # Whether the render of new messages after an assistant turn can be read apart (new_part): the
        # anchor's render must begin as the first prompt does (the user's message and the assistant's
        # opening, less a reasoning block the generation prompt may open).
        self._anchor_head = prompt[: _shared(prompt, following)]
        self.appends = len(reply) == 1 and await self.new_part([_PROBE_NEXT], affinity) is not None
        body = whole[len(prompt) :]
        if whole[: len(prompt)] == prompt and body[: len(reply)] == reply and len(body) > len(reply):
            self.end_of_turn = body[len(reply) :]
        elif not self.appends:
            self.unsupported = (
                "the chat template renders an assistant message in a conversation without its content as "
                "sampled, so neither a render of the whole conversation nor of the new messages alone can "
                "continue it token by token. Send tokens=chat (turns as messages, no trajectory), or serve the "
                "model with a chat template that keeps an assistant message's content in history"
            )

    async def new_part(self, new: list[dict], affinity: str | None) -> list[int] | None:
        """The template's render of `new` (the env's messages after an assistant turn) and the generation
        prompt, with the end of that assistant turn first: what follows the reply in the render of the
        probe's conversation followed by `new`, the reply found where that render and the one with
        another reply differ. None where no continuation is known: the renders do not begin with the
        anchor's head (a new message moved before it), differ elsewhere or otherwise than in one token,
        nothing follows the reply, or the template refuses the conversation (a tool message its template
        ties to a tool call the anchor's reply has not made)."""
        try:
            one, other = await asyncio.gather(
                self.render([*_PROBE_ANCHOR, *new], True, affinity),
                self.render([*_PROBE_ANCHOR_OTHER, *new], True, affinity),
            )
        except InferenceError as exc:
            if isinstance(exc, BadInferenceResponse) or exc.status in _DEFINITIVE:
                return None
            raise
        head = self._anchor_head
        if len(one) != len(other) or one[: len(head)] != head:
            return None
        differ = [at for at in range(len(head), len(one)) if one[at] != other[at]]
        if len(differ) != 1 or differ[0] == len(one) - 1:
            return None
        return one[differ[0] + 1 :]

    async def opening(self, messages: list[dict], affinity: str | None) -> Opening:
        """The render of `messages` and the generation prompt that opens a segment, shared with the
        group's other attempts that open on the same messages; the list is the caller's own."""
        if affinity is None:
            return await self._open(messages, None)
        held = self._openings.get(affinity)
        joined = held is not None and held[0] == messages
        if held is None or not joined:
            if held is None and len(self._openings) >= _MAX_OPENINGS:  # groups that never said they ended
                del self._openings[next(iter(self._openings))]
            render = asyncio.ensure_future(self._open(messages, affinity))
            render.add_done_callback(partial(self._opened, affinity))
            held = self._openings[affinity] = (list(messages), render)
        try:
            # Shielded: one attempt cancelled must not cancel the render the others wait for.
            ids, array = await asyncio.shield(held[1])
            return ids.snapshot(), array
        except InferenceError:
            if not joined:
                raise
        # The render this attempt joined failed: its own try, as if it had not shared (one failure
        # is the attempt that asked, not the whole group).
        return await self._open(messages, affinity)

    async def _open(self, messages: list[dict], affinity: str | None) -> Opening:
        answer = await self.answer(messages, True, affinity)
        return JsonList(answer.ids()), answer.array

    def _opened(self, affinity: str, render: asyncio.Future[Opening]) -> None:
        if render.cancelled() or render.exception() is not None:  # not kept: the next attempt asks again
            held = self._openings.get(affinity)
            if held is not None and held[1] is render:
                del self._openings[affinity]

    def forget(self, affinity: str) -> None:
        """The group is over: its opening is not kept."""
        self._openings.pop(affinity, None)

    async def render(self, messages: list[dict], add_generation_prompt: bool, affinity: str | None) -> list[int]:
        return (await self.answer(messages, add_generation_prompt, affinity)).ids()

    async def answer(self, messages: list[dict], add_generation_prompt: bool, affinity: str | None) -> TokenizeAnswer:
        """`render`'s /tokenize answer, unread."""
        return await self.client.tokenize(
            model=self.model, messages=messages, add_generation_prompt=add_generation_prompt, affinity=affinity
        )

    async def tokens_of(self, text: str, affinity: str | None) -> list[int]:
        """`text` alone, as the tokenizer splits it (no template, no special tokens added)."""
        return (await self.client.tokenize(model=self.model, text=text, affinity=affinity)).ids()


def _shared(a: list[int], b: list[int]) -> int:
    """How many ids `a` and `b` begin with alike."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n

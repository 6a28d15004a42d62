"""Exact trajectories: each attempt's turns as one token sequence that nothing re-tokenizes.

Sent as messages, every turn would have the server render the whole conversation again and
tokenize the earlier completions from their text, which need not give back the tokens the model
sampled. Here the first prompt is rendered once, each completion's own ids are appended, and of
what the env adds later only the new part is rendered: the chat template's render of the whole
conversation minus its render of the conversation so far, which is the same for both.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from inference.client import BadInferenceResponse, ChatClient, InferenceError, InferenceRejected

from ..protocol import CutReason, Segment, Turn, TurnSpan

# A tiny conversation whose render shows what the template puts after an assistant's content.
_PROBE_USER = {"role": "user", "content": "a"}
_PROBE_REPLY = "b"
# Answers that say for good that the server cannot do it (no such route, a template it cannot
# apply, not implemented); anything else (429, 401, 5xx, no answer) may pass and is asked again.
_DEFINITIVE = (400, 404, 405, 422, 501)


class TokenPromptsUnsupported(InferenceRejected):
    """The model server cannot take this service's token prompts (no /tokenize, or a chat template
    whose render of an assistant message this service cannot split)."""

    kind = "inference_rejected"


@dataclass
class TemplateRenderer:
    """Renders conversations to token ids with a model server's own chat template (/tokenize).

    `end_of_turn` is what the template appends after an assistant message's content (`<|im_end|>\\n`
    for ChatML), learnt once by rendering a probe conversation; a completion that stopped on the
    first of those tokens has already sampled it."""

    client: ChatClient
    model: str
    end_of_turn: list[int] | None = None
    unsupported: str | None = None  # why token prompts cannot be used, once known
    _probe_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def supported(self, affinity: str | None = None) -> bool:
        """Whether the server takes token prompts; probes once. Transport failures raise (and are not
        remembered: the next attempt probes again)."""
        if self.end_of_turn is not None or self.unsupported is not None:
            return self.unsupported is None
        async with self._probe_lock:
            if self.end_of_turn is None and self.unsupported is None:
                await self._probe(affinity)
        return self.unsupported is None

    async def _probe(self, affinity: str | None) -> None:
        try:
            prompt, whole, reply = await asyncio.gather(
                self.render([_PROBE_USER], True, affinity),
                self.render([_PROBE_USER, {"role": "assistant", "content": _PROBE_REPLY}], False, affinity),
                self.client.tokenize(model=self.model, text=_PROBE_REPLY, affinity=affinity),
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
            answer.prompt_token_ids is None  # an echo of another prompt is refused by the client
            or not choice.completion_token_ids
            or choice.logprobs is None
            or len(choice.logprobs) != len(choice.completion_token_ids)
        ):
            self.unsupported = "its /v1/completions does not return the prompt's ids, the token ids and logprobs"
            return
        body = whole[len(prompt) :]
        if whole[: len(prompt)] != prompt or body[: len(reply)] != reply or len(body) == len(reply):
            self.unsupported = (
                "the chat template does not render an assistant message as the generation prompt, the content "
                "and end-of-turn tokens (e.g. a template that renders the last assistant message apart, as "
                "Qwen3's thinking template does): this service cannot continue its conversations token by token"
            )
            return
        self.end_of_turn = body[len(reply) :]

    async def render(self, messages: list[dict], add_generation_prompt: bool, affinity: str | None) -> list[int]:
        return await self.client.tokenize(
            model=self.model, messages=messages, add_generation_prompt=add_generation_prompt, affinity=affinity
        )


@dataclass
class TrajectoryBuilder:
    """One try's trajectory. `prompt()` gives the token prompt for the next policy turn and `record()`
    takes the turn it produced; a turn of another model enters as env tokens with the next prompt."""

    renderer: TemplateRenderer
    affinity: str | None = None
    segments: list[Segment] = field(default_factory=list)
    # The conversation the open segment's tokens hold: the env's messages and the policy's own replies.
    _covered: list[dict] | None = None
    _stopped_on_end_of_turn: bool = False
    _cut_next: tuple[CutReason, str] | None = None

    async def prompt(self, messages: list[dict]) -> list[int]:
        cut, self._cut_next = self._cut_next, None
        if self._covered is not None and cut is None:
            cut = _rewritten(self._covered, messages)
            if cut is None:
                delta = await self._continuation(messages)
                if isinstance(delta, tuple):
                    cut = delta
                else:
                    segment = self.segments[-1]
                    segment.token_ids += delta
                    segment.loss_mask += [0] * len(delta)
                    segment.logprobs += [None] * len(delta)
                    self._covered = list(messages)
                    return list(segment.token_ids)
        ids = await self.renderer.render(messages, True, self.affinity)
        self.segments.append(
            Segment.model_construct(  # ids the server's answer had validated; masks built here
                token_ids=ids,
                loss_mask=[0] * len(ids),
                logprobs=[None] * len(ids),
                prompt_tokens=len(ids),
                cut=cut[0] if cut else None,
                cut_detail=cut[1] if cut else None,
            )
        )
        self._covered = list(messages)
        return list(ids)

    async def _continuation(self, messages: list[dict]) -> list[int] | tuple[CutReason, str]:
        """The tokens that follow the last completion: the template's end of turn (less what the model
        sampled of it), then the render of the new messages and the next generation prompt."""
        assert self._covered is not None and self.renderer.end_of_turn is not None
        whole, base = await asyncio.gather(
            self.renderer.render(messages, True, self.affinity),
            self.renderer.render(self._covered, False, self.affinity),
        )
        end = self.renderer.end_of_turn
        if whole[: len(base)] != base or base[len(base) - len(end) :] != end:
            return (
                "template_changed",
                "the chat template renders the conversation so far differently once the new messages follow it",
            )
        bridge = end[1:] if self._stopped_on_end_of_turn else end
        return bridge + whole[len(base) :]

    def record(self, turn: Turn, stopped_on_string: bool = False) -> None:
        """Append a policy turn's sampled ids (its prompt was the last `prompt()`). A turn ended by a stop
        string ends its segment: vLLM's ids may run past the string's end inside a token, so they may
        hold text the env never saw."""
        assert self._covered is not None and turn.completion_token_ids is not None
        segment = self.segments[-1]
        ids = turn.completion_token_ids
        start = len(segment.token_ids)
        segment.token_ids += ids
        if turn.trainable and turn.logprobs is not None and len(turn.logprobs) == len(ids):
            segment.loss_mask += [1] * len(ids)
            segment.logprobs += list(turn.logprobs)
        else:
            segment.loss_mask += [0] * len(ids)
            segment.logprobs += [None] * len(ids)
        segment.turns.append(
            TurnSpan.model_construct(
                turn=turn.index,
                start=start,
                end=len(segment.token_ids),
                trainable=turn.trainable,
                policy_version=turn.policy_version,
                policy_version_end=turn.policy_version_end,
            )
        )
        turn.segment = len(self.segments) - 1
        end = self.renderer.end_of_turn or []
        self._stopped_on_end_of_turn = bool(ids) and bool(end) and ids[-1] == end[0]
        self._covered = [*self._covered, {"role": "assistant", "content": turn.completion}]
        if stopped_on_string:
            self._cut_next = ("stop_string", f"turn {turn.index} ended on a stop string")


def _rewritten(covered: list[dict], messages: list[dict]) -> tuple[CutReason, str] | None:
    """Whether the env's messages still begin with the conversation so far (an env that condenses
    or rewrites its context starts a new segment)."""
    if len(messages) < len(covered):
        return ("history_rewritten", f"the env sent {len(messages)} messages where {len(covered)} were before")
    for i, (ours, theirs) in enumerate(zip(covered, messages, strict=False)):
        same = (
            ours.get("role") == theirs.get("role") and ours.get("content") == theirs.get("content")
            if ours.get("role") == "assistant"
            else ours == theirs
        )
        if not same:
            return ("history_rewritten", f"message {i} ({theirs.get('role')}) differs from the conversation so far")
    return None

"""Exact trajectories: each attempt's turns as one token sequence that nothing re-tokenizes.

Sent as messages, every turn would have the server render the whole conversation again and
tokenize the earlier completions from their text, which need not give back the tokens the model
sampled. Here the first prompt is rendered once (once for a group's attempts that open on the same
messages), each completion's own ids are appended, and of what the env adds later only the new
part is taken: the chat template's render of the whole conversation, read on from its previous
render past the last reply as the template tokenized it (TrajectoryBuilder._continuation says the
three ways that is found), which is the same for both.

Some templates render the conversation so far otherwise once more follows it: reasoning models'
(Qwen3's, DeepSeek-R1's) drop an earlier turn's reasoning from history, or wrap only the last reply in
a reasoning block, or open one in the generation prompt. A fresh render would then not be what the
model saw, so the segment keeps the tokens it holds (the prompt, each completion exactly as sampled,
reasoning included) and appends only the template's render of what is new: the end of the assistant
turn where the model did not sample it, the env's new messages and the generation prompt, read from
the render of a fixed two-message conversation followed by the new messages
(TemplateRenderer.new_part). The segment says so (`prompts: "appended"`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

from ...backends.json_body import JsonList, dumps
from ...backends.template_renderer import TemplateRenderer
from ...protocol import CutReason, Segment, Turn, TurnSpan
from ..metrics import Continuation


@dataclass
class TrajectoryBuilder:
    """One try's trajectory. `prompt()` gives the token prompt for the next policy turn and `record()`
    takes the turn it produced; a turn of another model enters as env tokens with the next prompt."""

    renderer: TemplateRenderer
    affinity: str | None = None
    segments: list[Segment] = field(default_factory=list)
    # How the last prompt() found where the env's new messages begin (see _continuation); None: it
    # began a segment.
    continued: Continuation | None = None
    # The conversation the open segment's tokens hold: the env's messages and the policy's own replies.
    _covered: list[dict] | None = None
    # The template's own render of the conversation up to the last prompt (its replies as the template
    # tokenizes them, not as sampled), as vLLM's JSON array: where the next render is read on from.
    _rendered: bytes | None = None
    _stopped_on_end_of_turn: bool = False
    _ended_on: int | None = None
    _cut_next: tuple[CutReason, str] | None = None
    # The open segment went on by appending (`TemplateRenderer.new_part`): its tokens are no longer the
    # template's render of the conversation, so it goes on so to its end.
    _appending: bool = False

    async def prompt(self, messages: list[dict]) -> list[int]:
        """The next turn's prompt ids for the env's `messages`: the open segment's own list (not a copy;
        it keeps its JSON for the request), valid until the turn's `record` grows it."""
        cut, self._cut_next = self._cut_next, None
        self.continued = None
        if self._covered is not None and cut is None:
            cut = _rewritten(self._covered, messages)
            if cut is None:
                delta, self._rendered = await self._continuation(messages)
                if isinstance(delta, tuple):
                    cut = delta
                else:
                    token_ids, loss_mask, logprobs = self._open_arrays()
                    token_ids.grow(delta)
                    loss_mask.repeat(0, len(delta))
                    logprobs.repeat(None, len(delta))
                    self._covered = list(messages)
                    return token_ids
        token_ids, self._rendered = await self.renderer.opening(messages, self.affinity)
        self._appending = self.renderer.end_of_turn is None
        loss_mask, logprobs = JsonList(), JsonList()
        loss_mask.repeat(0, len(token_ids))
        logprobs.repeat(None, len(token_ids))
        self.segments.append(
            Segment.model_construct(  # ids the server's answer had validated; masks built here
                token_ids=token_ids,
                loss_mask=loss_mask,
                logprobs=logprobs,
                prompt_tokens=len(token_ids),
                turns=[],  # given: pydantic inspects a default factory's signature on each call
                cut=cut[0] if cut else None,
                cut_detail=cut[1] if cut else None,
                prompts="rendered",
            )
        )
        self._covered = list(messages)
        return token_ids

    async def _continuation(self, messages: list[dict]) -> tuple[list[int] | tuple[CutReason, str], bytes | None]:
        """The tokens that follow the last completion: the template's end of turn (less what the model
        sampled of it), then the render of the new messages and the next generation prompt; and the
        render of the whole conversation as JSON (the next turn's `_rendered`), where it is known.

        The whole render goes on from the last one (`_rendered`, which ends with the generation
        prompt) with the last reply as the template tokenizes it, the end of turn, then the new part.
        The reply's length there is found the cheapest way the render confirms token for token:
        1. the ids the model sampled (a reply the tokenizer splits as the model did);
        2. else the reply's text tokenized on its own (a short /tokenize; not asked while it seldom
           holds for this template and model: `_Odds`);
        3. else the conversation so far rendered apart (a /tokenize of the whole length), which also
           tells a template that renders it differently once more follows: then the tokens held are
           kept and only the new part appended (`_appended`), or, where that cannot be read, a cut.
        The first two read the answer's bytes after the last render's (TokenizeAnswer.after): the ids
        known already are not decoded again. A server that does not write vLLM's compact JSON, or a
        template whose generation prompt joins the reply's first token, gets the third."""
        if self._appending:
            return await self._appended(messages), None
        assert self._covered is not None and self.renderer.end_of_turn is not None
        end = self.renderer.end_of_turn
        bridge = end[1:] if self._stopped_on_end_of_turn else end
        sampled = self.segments[-1].turns[-1]
        answer = await self.renderer.answer(messages, True, self.affinity)
        if self._rendered is not None:
            # Compared as bytes too: only the env's new part is decoded.
            reply_ids = self.segments[-1].token_ids[sampled.start : sampled.end] + bridge
            known = self._rendered[:-1] + b"," + dumps(reply_ids)[1:] if reply_ids else self._rendered
            new = answer.after(known)
            if new is not None:
                self.continued = "from_samples"
                return bridge + new, answer.array
            rest = answer.after(self._rendered) if self.renderer.replies_alone.worth_asking() else None
            if rest is not None:
                reply = await self.renderer.tokens_of(self._covered[-1]["content"], self.affinity)
                held = _holds(rest, reply, 0) and _holds(rest, end, len(reply))
                self.renderer.replies_alone.saw(held)
                if held:
                    self.continued = "from_reply"
                    return bridge + rest[len(reply) + len(end) :], answer.array
        whole = answer.ids()
        base = await self.renderer.render(self._covered, False, self.affinity)
        if not _holds(whole, base, 0) or base[len(base) - len(end) :] != end:
            if self.renderer.appends:  # kept as held, the new part appended
                return await self._appended(messages), None
            cut: tuple[CutReason, str] = (
                "template_changed",
                "the chat template renders the conversation so far differently once the new messages follow it",
            )
            return cut, None
        self.continued = "rendered_apart"
        return bridge + whole[len(base) :], answer.array

    async def _appended(self, messages: list[dict]) -> list[int] | tuple[CutReason, str]:
        """The tokens that follow the last completion where the template's render of the whole
        conversation does not: the template's render of the env's new messages, with the end of the
        assistant turn first (less its first token where the model sampled it) and the generation
        prompt last. The segment is marked `appended` from here on."""
        assert self._covered is not None
        part = await self.renderer.new_part(messages[len(self._covered) :], self.affinity)
        if not part:
            return (
                "template_changed",
                "the chat template renders the conversation so far differently once the new messages follow it, "
                "and its render of the new messages cannot be read apart",
            )
        self._appending, self.continued = True, "appended"
        self.segments[-1].prompts = "appended"
        return part[1:] if self._ended_on == part[0] else part

    def _open_arrays(self) -> tuple[JsonList, JsonList, JsonList]:
        """The open segment's token_ids, loss_mask and logprobs: JsonLists (prompt() made them so),
        which keep their JSON as they grow."""
        segment = self.segments[-1]
        return cast(JsonList, segment.token_ids), cast(JsonList, segment.loss_mask), cast(JsonList, segment.logprobs)

    def record(self, turn: Turn, stopped_on_string: bool = False) -> None:
        """Append a policy turn's sampled ids (its prompt was the last `prompt()`). A turn ended by a stop
        string ends its segment: vLLM's ids may run past the string's end inside a token, so they may
        hold text the env never saw."""
        assert self._covered is not None and turn.completion_token_ids is not None
        segment = self.segments[-1]
        ids = turn.completion_token_ids
        token_ids, loss_mask, logprobs = self._open_arrays()
        start = len(token_ids)
        token_ids.grow(ids)
        if turn.trainable and turn.logprobs is not None and len(turn.logprobs) == len(ids):
            loss_mask.repeat(1, len(ids))
            logprobs.grow(turn.logprobs)
        else:
            loss_mask.repeat(0, len(ids))
            logprobs.repeat(None, len(ids))
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
        # The token a completion stopped on, where it sampled one (its EOS): a completion cut at max_tokens
        # may end on the same token as content ("\n"), which is not the end of its turn.
        self._ended_on = ids[-1] if ids and turn.finish_reason == "stop" else None
        end = self.renderer.end_of_turn or []
        self._stopped_on_end_of_turn = bool(end) and self._ended_on == end[0]
        self._covered = [*self._covered, {"role": "assistant", "content": turn.completion}]
        if stopped_on_string:
            self._cut_next = ("stop_string", f"turn {turn.index} ended on a stop string")


def _holds(ids: list[int], part: list[int], at: int) -> bool:
    """Whether `ids` has `part` at `at`."""
    return ids[at : at + len(part)] == part


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

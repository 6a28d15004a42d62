"""`refenv teacher`: a scripted oracle teacher behind an OpenAI-compatible chat API.

It is not a model. It stands in for a larger teacher model on a machine that has none (a CPU-only
one): it recognizes the refenv task from the conversation (the first user message is the task's
prompt, as refenv's agent sends it) and answers the way the task's hidden oracle does:

- executor stage, before the oracle's query ran: `{"action": "sql", "input": <the oracle SQL>}`
  (for a write task, the reference UPDATE);
- executor stage, once a `Result:` of that query followed it: `{"action": "answer", "input": ...}`
  with the expected answer (computed on the pristine database, formatted so that refenv's
  `answer_matches` accepts it), or `"done"` for a write task;
- finalize stage ("You are out of turns..."): `{"answer": ...}` with the same answer;
- responder stage ("Phrase the answer below..."): one short sentence.

Anything else gets an OpenAI-style 400. The answers are deterministic: `temperature`, `seed`,
`max_tokens` and the `response_format` are accepted and ignored, and `n` choices are `n` copies of
the one answer. Token counts in `usage` are rough whitespace-split counts; no token ids and no
logprobs are returned (ask it as a non-vLLM server: `token-ids=false`). It knows the tasks only
from its task-suite flags (`--seed`, `--scale`, `--split`, `--side`): start it with the same ones
as the `refenv serve` whose episodes it answers, or its answers are those of another world.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from refenv.agent import parse_action
from refenv.config import TaskSuite, TeacherSettings
from refenv.tasks import Task
from refenv.text import loads_clean

MAX_BODY_BYTES = 4 << 20
MAX_CHOICES = 64
RESULT_PREFIX = "Result:\n"
FINALIZE_TEXT = "You are out of turns. Give your final answer now."
RESPONDER_SYSTEM = "Phrase the answer below for the user in one short sentence."


class TeacherError(Exception):
    """An OpenAI-style error answer: `{"error": {"message", "type", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


def expected_answer(task: Task) -> str:
    """The task's answer as the oracle gives it: what `answer_matches` accepts; `done` for a write."""
    if task.writes:
        return "done"
    expected = task.expected
    if task.answer_kind == "list":
        assert isinstance(expected, list)
        return ", ".join(str(v) for v in expected)
    if task.answer_kind == "int":
        assert isinstance(expected, int)
        return str(expected)
    if task.answer_kind == "money":
        assert isinstance(expected, int | float)
        return f"{expected:.2f}"
    return str(expected)


def _content(message: object, index: int) -> tuple[str, str]:
    """(role, text) of one message; content given as OpenAI's text parts is joined."""
    if not isinstance(message, dict):
        raise TeacherError(400, f"messages[{index}] is not an object")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str):
        raise TeacherError(400, f"messages[{index}].role is missing")
    if content is None:
        return role, ""
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        return role, "".join(p for p in parts if isinstance(p, str))
    if not isinstance(content, str):
        raise TeacherError(400, f"messages[{index}].content is neither text nor a list of text parts")
    return role, content


@dataclass
class OracleTeacher:
    """The scripted answers for one task suite."""

    tasks: list[Task]

    def __post_init__(self) -> None:
        self.by_prompt: dict[str, Task] = {}
        for task in self.tasks:
            if task.prompt in self.by_prompt:  # never in refenv's suite; it would make the teacher guess
                raise ValueError(f"tasks {self.by_prompt[task.prompt].task_id} and {task.task_id} share a prompt")
            self.by_prompt[task.prompt] = task

    def _task(self, prompt: str) -> Task:
        task = self.by_prompt.get(prompt.strip())
        if task is None:
            raise TeacherError(
                400,
                "unknown conversation: its first user message is not the prompt of any task this oracle teacher "
                "serves (is it started with the env's --seed/--scale/--split/--side?)",
            )
        return task

    def answer(self, messages: list[tuple[str, str]]) -> str:
        """The assistant's next message in this conversation; TeacherError when it is not a refenv one."""
        if not messages:
            raise TeacherError(400, "messages is empty")
        system = next((text for role, text in messages if role == "system"), None)
        users = [text for role, text in messages if role == "user"]
        if not users:
            raise TeacherError(400, "unknown conversation: it has no user message")
        if messages[-1][0] != "user":
            raise TeacherError(400, "unknown conversation: it does not end with a user message")
        if system is not None and system.strip() == RESPONDER_SYSTEM:
            return self._responder(users[0])
        task = self._task(users[0])
        if messages[-1][1] == FINALIZE_TEXT:
            return json.dumps({"answer": expected_answer(task)})
        if self._oracle_ran(task, messages):
            return json.dumps({"action": "answer", "input": expected_answer(task)})
        return json.dumps({"action": "sql", "input": task.oracle})

    @staticmethod
    def _oracle_ran(task: Task, messages: list[tuple[str, str]]) -> bool:
        """Whether the oracle's statement was sent and its result (not an error) came back."""
        for (role, text), (next_role, next_text) in zip(messages, messages[1:], strict=False):
            if role != "assistant" or parse_action(text) != ("sql", task.oracle):
                continue
            if next_role == "user" and next_text.startswith(RESULT_PREFIX):
                if not next_text.removeprefix(RESULT_PREFIX).startswith("Error:"):
                    return True
        return False

    def _responder(self, user: str) -> str:
        question, sep, answer = user.partition("\nAnswer: ")
        if not sep or not question.startswith("Question: "):
            raise TeacherError(400, "unknown conversation: a responder stage without 'Question: ...\\nAnswer: ...'")
        task = self._task(question.removeprefix("Question: "))
        answer = answer.strip()
        if task.writes:
            return "Done: the change you asked for has been made."
        return f"The answer is {answer}."


def _tokens(text: str) -> int:
    return max(1, len(text.split()))


async def _read_body(request: Request) -> dict:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise TeacherError(400, f"request body exceeds {MAX_BODY_BYTES >> 20} MiB")
        chunks.append(chunk)
    try:
        data = loads_clean(b"".join(chunks))  # its text is echoed: a lone surrogate would fail the answer
    except (ValueError, RecursionError) as exc:
        raise TeacherError(400, f"body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise TeacherError(400, "body must be a JSON object")
    return data


def create_app(teacher: TeacherSettings, suite: TaskSuite) -> Starlette:
    _, tasks = suite.load()
    oracle = OracleTeacher(tasks)
    name = teacher.name

    async def models(request: Request) -> JSONResponse:
        return JSONResponse(
            {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "refenv"}]}
        )

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ready", "model": name, "tasks": len(tasks), "scripted": True})

    async def chat(request: Request) -> JSONResponse:
        body = await _read_body(request)
        model = body.get("model")
        if model is not None and model != name:
            raise TeacherError(
                404, f"The model `{model}` does not exist; this server serves `{name}`.", "NotFoundError"
            )
        raw = body.get("messages")
        if not isinstance(raw, list):
            raise TeacherError(400, "messages must be a list")
        n = body.get("n") if body.get("n") is not None else 1
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
            raise TeacherError(400, f"n must be an integer from 1 to {MAX_CHOICES}")
        messages = [_content(m, i) for i, m in enumerate(raw)]
        text = oracle.answer(messages)
        prompt_tokens = max(1, sum(len(t.split()) for _, t in messages))
        completion_tokens = _tokens(text) * n
        return JSONResponse(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": name,
                "choices": [
                    {"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                    for i in range(n)
                ],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            }
        )

    async def teacher_error(request: Request, exc: TeacherError) -> JSONResponse:
        return JSONResponse(
            {"error": {"message": exc.message, "type": exc.kind, "param": None, "code": exc.status}},
            status_code=exc.status,
        )

    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        status = exc.status_code
        kind = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(status, "BadRequestError")
        return JSONResponse(
            {"error": {"message": str(exc.detail), "type": kind, "param": None, "code": status}}, status_code=status
        )

    app = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ],
        exception_handlers={TeacherError: teacher_error, HTTPException: http_error},  # type: ignore[dict-item]
    )
    app.state.oracle = oracle
    return app

"""The OpenAI-compatible HTTP server in front of the rollout engine (``rollout.agent=openai``).

aiohttp on its own event loop, on a daemon thread of the driver, bound to
``agent.server_host`` (127.0.0.1 by default: nothing outside this machine can reach it) and
``agent.server_port`` (0: an ephemeral port). Routes: ``POST /v1/chat/completions``
(non-streaming, n=1) and ``GET /v1/models``. Every failure is an OpenAI-shaped error
(``{"error": {"message", "type", "param", "code"}}``) with its HTTP status (a bad request:
4xx, typed ``invalid_request_error``); nothing a client sends stops the run. A connection
has ``agent.server_header_timeout_s`` to send a request's headers and
``agent.server_body_timeout_s`` for its body; open connections are capped
(:mod:`rlframe.agent_server.guard`), and the server's own failures go to the driver's log,
once a minute at most, not to the console.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from rlframe.agent_server.guard import (
    BACKLOG,
    ConnectionGuard,
    QuietAiohttp,
    RateLimitedLog,
    plan_connection_cap,
    widen_listen_queue,
)
from rlframe.agent_server.replies import ReplyBuilder
from rlframe.agent_server.requests import (
    HTTP_CODES,
    MAX_JSON_DEPTH,
    APIError,
    check_params,
    error_response,
    measure_depth,
)
from rlframe.agent_server.sessions import Session, SessionRegistry
from rlframe.agent_server.trajectory import Episode, normalize_message
from rlframe.config import Config
from rlframe.config.agent import compute_response_width, is_loopback, url_host
from rlframe.core.tokenizer import Tokenizer
from rlframe.envs.chat import ChatFormat
from rlframe.rollout.multi_turn import mix_seed
from rlframe.rollout.turns import TurnRequest, TurnServer, sample_turn

LINGER_S = 2.0
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def answer_openai_style(
    request: web.Request, handler: Handler, failures: RateLimitedLog
) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as e:
        return error_response(e.status, e.message, e.code, e.param)
    except web.HTTPException as e:  # 404 route, 405 method, 413 body too large
        code = HTTP_CODES.get(e.status, "http_error")
        return error_response(e.status, e.reason or str(e), code)
    except Exception as e:  # the engine failed: the client hears of it, the server goes on
        # One line, no traceback: a Ray error's text holds the worker's traceback (with its
        # colour codes). The driver's log notes the failure (rate-limited, its text's start).
        failures.note("a request failed", f"{type(e).__name__}: {e}")
        return error_response(500, describe_server_error(e), "server_error")


ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def describe_server_error(error: BaseException) -> str:
    """The 500's message: the error's type and the first line of its text, without colour
    codes, at most 300 characters."""
    text = ANSI_ESCAPE.sub("", str(error)).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(error).__name__}: {first}"[:300]


class AgentServer:
    """Args: the run's config, the request stream to the engines, the tokenizer, the model's
    name. Each chat completion is one request of the stream, sent as it arrives; a session's
    requests go to one engine replica."""

    def __init__(
        self, cfg: Config, turns: TurnServer, tokenizer: Tokenizer, model_name: str
    ) -> None:
        self.cfg, self.tokenizer, self.model_name = cfg, tokenizer, model_name
        self.agent = cfg.agent
        self.sessions = SessionRegistry()
        self.turns = turns
        self.stop_ids: tuple[int, ...] = ()
        self.temperature: float | None = None
        """The batch's sampling (:meth:`sample_like`): its stop ids; greedy for ReMax's
        baseline, validation's temperature, else (None) the run's."""
        self.replies = ReplyBuilder(tokenizer, self.agent.tool_parser)
        self.formats: dict[str, ChatFormat] = {}
        """Chat formats by tool set, shared by the episodes (:class:`Episode`'s ``formats``):
        used on the server's loop only."""
        self.width = compute_response_width(cfg.rollout.max_tokens, cfg.rollout.agent, self.agent)
        self.in_flight = 0
        self.loop = asyncio.new_event_loop()
        self.runner: web.AppRunner | None = None
        self.listener: asyncio.base_events.Server | None = None
        self.guard: ConnectionGuard | None = None
        self.failures = RateLimitedLog()
        self.quiet = QuietAiohttp(self.failures)
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://{url_host(self.agent.server_host)}:{self.port}/v1"

    # -- lifecycle ---------------------------------------------------------------------

    def describe(self) -> str:
        """The start-up line: where the endpoint listens and what bounds it."""
        assert self.guard is not None
        reach = (
            "reachable from other machines (agent.server_allow_remote)"
            if self.agent.server_allow_remote and not is_loopback(self.agent.server_host)
            else "this machine only"
        )
        return (
            f"agent server: {self.base_url} ({reach}; at most {self.guard.cap} connections, "
            f"{self.agent.server_header_timeout_s:g} s for headers, "
            f"{self.agent.server_body_timeout_s:g} s for a body)"
        )

    def start(self) -> None:
        ready, failure = threading.Event(), []

        def serve() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                self.loop.run_until_complete(self.listen())
            except BaseException as e:
                failure.append(e)
                ready.set()
                return
            ready.set()
            self.loop.run_forever()

        threading.Thread(target=serve, daemon=True, name="agent-server").start()
        ready.wait(60)
        if failure:
            raise failure[0]

    async def listen(self) -> None:
        app = web.Application(
            middlewares=[self.middleware], client_max_size=self.agent.max_request_bytes
        )
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        # aiohttp's keep-alive timer also runs from a connection's opening and is not reset
        # by partial headers: it is the time allowed to send a request's headers. After an
        # answer sent before the whole body came (401, 408, 413), the rest is read and
        # dropped for at most LINGER_S.
        self.runner = web.AppRunner(
            app,
            access_log=None,
            keepalive_timeout=self.agent.server_header_timeout_s,
            lingering_time=min(LINGER_S, self.agent.server_body_timeout_s),
        )
        await self.runner.setup()
        assert self.runner.server is not None
        cap = plan_connection_cap(self.agent.server_max_connections)
        self.guard = ConnectionGuard(self.runner.server, cap)
        self.loop.set_exception_handler(self.failures.loop_exception)
        logging.getLogger("aiohttp.server").addFilter(self.quiet)
        self.listener = await self.loop.create_server(
            self.guard, self.agent.server_host, self.agent.server_port, backlog=BACKLOG
        )
        widen_listen_queue(self.listener, cap)
        self.port = int(self.listener.sockets[0].getsockname()[1])

    async def close_sockets(self) -> None:
        if self.listener is not None:
            self.listener.close()
        if self.runner is not None:
            await self.runner.cleanup()

    def stop(self) -> None:
        if self.runner is not None and self.loop.is_running():
            asyncio.run_coroutine_threadsafe(self.close_sockets(), self.loop).result(10)
            self.loop.call_soon_threadsafe(self.loop.stop)
        logging.getLogger("aiohttp.server").removeFilter(self.quiet)

    def sample_like(self, meta: dict[str, Any]) -> None:
        """Sample the next batch's episodes as its meta says (stop ids, ``greedy``,
        ``temperature``): the log-probs the trainer assumes."""
        self.stop_ids = tuple(int(t) for t in meta["stop_token_ids"])
        self.temperature = 0.0 if meta.get("greedy") else meta.get("temperature")

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """OpenAI-shaped errors, and the guard told which connections have a request."""
        assert self.guard is not None
        self.guard.request_started(request.protocol)
        try:
            return await answer_openai_style(request, handler, self.failures)
        finally:
            self.guard.request_done(request.protocol)

    # -- routes ------------------------------------------------------------------------

    def session_of(self, request: web.Request) -> Session:
        header = request.headers.get("Authorization", "")
        key = header[len("Bearer ") :] if header.startswith("Bearer ") else ""
        session = self.sessions.get(key)
        if session is None or session.closed:
            raise APIError(
                401, "unknown or finished session key: each episode has its own key, "
                "valid until the episode ends", "invalid_api_key",
            )  # fmt: skip
        return session

    async def models(self, request: web.Request) -> web.Response:
        self.session_of(request)
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rlframe"}
        return web.json_response({"object": "list", "data": [model]})

    async def chat_completions(self, request: web.Request) -> web.Response:
        session = self.session_of(request)
        try:
            # asyncio.timeout, not wait_for: wait_for wraps the read in a task of its own,
            # a tenth of the server's CPU per call here.
            async with asyncio.timeout(self.agent.server_body_timeout_s):
                raw = await request.read()
        except TimeoutError:
            raise APIError(
                408, f"the body took more than agent.server_body_timeout_s="
                f"{self.agent.server_body_timeout_s} s to arrive", "request_timeout",
            ) from None  # fmt: skip
        try:
            body = json.loads(raw)
        except RecursionError:
            raise APIError(
                400, f"the body is nested more than {MAX_JSON_DEPTH} levels deep", "invalid_json"
            ) from None
        # ValueError: bad JSON (JSONDecodeError), or an integer past Python's digit limit.
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the body is not valid JSON: {e}", "invalid_json") from None
        if measure_depth(body) > MAX_JSON_DEPTH:
            raise APIError(
                400, f"the body is nested more than {MAX_JSON_DEPTH} levels deep", "invalid_json"
            )
        check_params(body, self.cfg.rollout.temperature, self.cfg.rollout.top_p)
        if self.in_flight >= self.agent.max_pending_requests:
            raise APIError(
                429, f"{self.in_flight} requests are in progress, the most "
                f"agent.max_pending_requests={self.agent.max_pending_requests} allows",
                "rate_limit_exceeded",
            )  # fmt: skip
        self.in_flight += 1
        try:
            return web.json_response(await self.complete(session, body))
        finally:
            self.in_flight -= 1

    async def complete(self, session: Session, body: dict[str, Any]) -> dict[str, Any]:
        episode = session.episode
        messages = [normalize_message(m) for m in body["messages"]]
        tools = body.get("tools") or None
        try:
            plan = episode.plan(messages, tools)
        except Exception as e:  # the template cannot render these messages
            raise APIError(400, f"cannot render the messages: {e}", "invalid_request") from None
        if not plan.context:  # an engine cannot continue nothing (vLLM raises, after Ray)
            raise APIError(
                400, "the messages render to no tokens: give a message some content",
                "invalid_request", "messages",
            )  # fmt: skip
        max_tokens = self.allowed_tokens(plan, body)
        if plan.new_row:
            self.check_row_cap(episode)
        seed = mix_seed(session.seed, session.calls)
        session.calls += 1
        episode.begin(plan)
        try:
            request = TurnRequest(plan.context, seed, max_tokens, self.stop_ids, self.temperature)
            turn = await sample_turn(self.turns, request, session.key)
        finally:
            episode.end(plan)
        if session.closed:
            raise APIError(401, "the episode ended while this call ran", "invalid_api_key")
        kept, reply, finish_reason = self.replies.build(turn, body, tools)
        episode.commit(plan, messages, reply, kept)
        episode.tool_calls += len(reply.get("tool_calls") or [])
        prompt_tokens = len(plan.context)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": str(body.get("model") or self.model_name),
            "choices": [
                {"index": 0, "message": reply, "finish_reason": finish_reason, "logprobs": None}
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(kept[0]),
                "total_tokens": prompt_tokens + len(kept[0]),
            },
        }

    def check_row_cap(self, episode: Episode) -> None:
        """A call that starts a row past ``agent.max_rows_per_episode`` gets a 400: each row
        is a response of the prompt's group, so an agent that restarts its conversation
        over and over multiplies the step's work (20 restarts: 5,120 rows, 6-8x slower)."""
        cap = self.cfg.agent.max_rows_per_episode
        if len(episode.rows) + episode.new_rows_in_flight >= cap:
            raise APIError(
                400,
                f"this episode already has {cap} training rows (agent.max_rows_per_episode="
                f"{cap}); a call that does not extend one of the episode's earlier "
                "conversations starts another: continue a conversation, or raise the cap",
                "invalid_request",
                "messages",
            )

    def allowed_tokens(self, plan: Any, body: dict[str, Any]) -> int:
        """The call's cap: what it asks, the per-call cap, and what is left of the row's
        budgets (sampled tokens, response width, prompt length)."""
        budget = self.cfg.rollout.max_tokens
        if plan.new_row and len(plan.row.prompt_ids) > self.cfg.data.max_prompt_length:
            raise APIError(
                400, f"the conversation is {len(plan.row.prompt_ids)} tokens, more than "
                f"data.max_prompt_length={self.cfg.data.max_prompt_length} for a new row",
                "context_length_exceeded", "messages",
            )  # fmt: skip
        response = 0 if plan.new_row else len(plan.row.response_ids) + len(plan.added)
        sampled = 0 if plan.new_row else plan.row.sampled
        asked = body.get("max_completion_tokens") or body.get("max_tokens") or budget
        allowed = min(
            int(asked), self.agent.max_tokens_per_turn or budget, budget - sampled,
            self.width - response,
        )  # fmt: skip
        if allowed <= 0:
            raise APIError(
                400, f"the episode's row is full: {sampled} of rollout.max_tokens={budget} "
                f"sampled tokens, {response} of {self.width} response tokens used",
                "context_length_exceeded", "messages",
            )  # fmt: skip
        return allowed

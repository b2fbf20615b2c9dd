"""The OpenAI-compatible HTTP server: `create_app(engine, model_name)` → a FastAPI app.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (SSE with `stream: true`),
GET /health, GET /metrics, and vLLM's: POST /v1/chat/completions/batch (several conversations, one choice each),
POST /tokenize and /detokenize, GET /version, GET /load, GET/POST /ping and POST /invocations (SageMaker),
GET /tokenizer_info (with ServerOptions.enable_tokenizer_info_endpoint), and in dev mode (ServerOptions.server_dev_mode,
vLLM's VLLM_SERVER_DEV_MODE) sleep mode: POST /sleep?level=0|1&mode=abort|wait|keep, POST /wake_up?tags=...,
GET /is_sleeping (EngineLoop.sleep says what each does). `use_beam_search` (vLLM's) on both generation endpoints runs
a BeamSearchStream (serving/beam_search.py) in place of the engine requests. A non-streamed generation response carries
vLLM's ORCA load report (the `endpoint-load-metrics` header) when the request's `endpoint-load-metrics-format`
header asks for one (TEXT or JSON).
Errors are OpenAI-style bodies ({"error": {"message", "type", "param", "code"}}):
bad input is a 4xx before any work (types by pydantic, ranges by SamplingParams and the InputProcessor), and a
final handler turns anything unexpected into a 500 that carries an error id, logged with its traceback. The API
key is checked before the body is read. A client that disconnects (streaming or not) has its request aborted
at once, which frees its KV blocks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import secrets
import time
import uuid
from typing import Any, AsyncIterator, Callable

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from trtopt import __version__
from trtopt.errors import ConfigError, RequestError
from trtopt.runtime.batch import RequestOutput
from trtopt.runtime.beam_search import BeamSearchParams
from trtopt.runtime.engine import LLMEngine
from trtopt.serving.async_engine import (
    AsyncLLMEngine, EngineDeadError, PreparedRequest, RequestAbortedError, RequestStream,
)
from trtopt.serving.beam_search import BeamSearchStream
from trtopt.serving.engine_loop import DEFAULT_STOP_TIMEOUT_S
from trtopt.runtime.structured_output import ReasoningGatedGrammar
from trtopt.serving.metrics import ORCA_FORMAT_HEADER, LatencyTracker, ServingMetrics, orca_headers
from trtopt.serving.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ErrorInfo, TokenizeRequest, usage,
)
from trtopt.serving.reasoning import THINK_END, THINK_START, ReasoningRule, get_reasoning_parser
from trtopt.serving.render import BatchChatRenderer, ChatRenderer, CompletionRenderer, Renderer, RenderOptions
from trtopt.serving.structured import is_auto_tool_choice
from trtopt.serving.tool_parsers import TOOL_CALL_ID_TYPES, check_tool_options

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: far more than any prompt a max_model_len of thousands can hold


class APIError(Exception):
    """Raised inside a handler to answer with an OpenAI-style error."""

    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(info.message)
        self.info = info


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """vLLM's server switches (`vllm serve` flags of the same names)."""

    root_path: str = ""  # the path prefix a proxy routes to this server ("/llm"); routes answer with and without it
    enable_server_load_tracking: bool = False  # GET /load counts in-flight generation requests (else it stays 0)
    enable_tokenizer_info_endpoint: bool = False  # GET /tokenizer_info (it shows the chat template and special tokens)
    enable_force_include_usage: bool = False  # every stream carries usage (on every chunk, and a final usage chunk)
    trust_request_chat_template: bool = False  # a request may send its own chat_template (a Jinja program)
    return_tokens_as_token_ids: bool = False  # the default of the request field of that name
    reasoning_parser: str | None = None  # a parser of trtopt.serving.reasoning: chat replies split off their reasoning
    enable_auto_tool_choice: bool = False  # tool_choice "auto": the model decides, tool_call_parser reads its calls
    tool_call_parser: str | None = None  # a parser of trtopt.serving.tool_parsers (with enable_auto_tool_choice)
    enable_request_id_headers: bool = False  # every response carries X-Request-Id (the client's, else a new uuid4)
    server_dev_mode: bool = False  # vLLM's VLLM_SERVER_DEV_MODE: serve /sleep, /wake_up and /is_sleeping
    enable_sleep_mode: bool = False  # vLLM's --enable-sleep-mode: /sleep may free the KV cache (level 1)
    tool_call_id_type: str = "random"  # "kimi_k2": tool call ids are functions.<name>:<index> (vLLM's rule)


_INVOCATION_TYPES = "['ChatCompletionRequest', 'CompletionRequest']"


def create_app(engine: LLMEngine | AsyncLLMEngine, model_name: str, *, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, protect_metrics: bool = False,
               options: ServerOptions = ServerOptions()) -> FastAPI:
    """An app serving `engine` under the model id `model_name`.

    api_key: when set, /v1/*, /v2/*, /tokenize, /detokenize, /invocations and /tokenizer_info need
        `Authorization: Bearer <api_key>`, checked before the body is read. /health, /ping, /version and /load stay
        open; /metrics too unless protect_metrics.
    max_body_bytes: larger request bodies get 413 before any parsing.
    """
    aengine = engine if isinstance(engine, AsyncLLMEngine) else AsyncLLMEngine(engine)
    metrics = ServingMetrics(aengine.stats, aengine.max_model_len, model_name, sleep_level=lambda: aengine.sleep_level)

    @contextlib.asynccontextmanager
    async def lifespan(app_: FastAPI):
        aengine.start()
        yield
        aengine.stop(app_.state.stop_timeout)

    app = FastAPI(title="trtopt", lifespan=lifespan)
    app.root_path = options.root_path  # as vLLM sets it: Starlette routes /x and <root_path>/x alike
    app.state.engine = aengine
    app.state.metrics = metrics
    app.state.server_load_metrics = 0  # vLLM's name: generation requests in flight (with load tracking)
    app.state.stop_timeout = DEFAULT_STOP_TIMEOUT_S  # how long the final stop may join the step thread
    # Starlette runs the last-added middleware first: the key is checked before the body is even received.
    app.add_middleware(_BodyLimitMiddleware, max_body_bytes=max_body_bytes)
    if api_key is not None:
        # /tokenize, /detokenize and /invocations take a body as large as a prompt's, /tokenizer_info shows the
        # chat template: the key guards them like /v1/* and /v2/* (vLLM guards /v1 and /v2: a /v2 path without the
        # key is a 401 even where trtopt serves no such route, as vLLM's test_optional_middleware checks).
        protected = ("/v1/", "/v2/", "/tokenize", "/detokenize", "/invocations", "/tokenizer_info", "/sleep", "/wake_up")
        protected += ("/metrics",) if protect_metrics else ()
        app.add_middleware(_AuthMiddleware, api_key=api_key, protected=protected)
    if options.enable_request_id_headers:  # outermost, as in vLLM: a 401 or 413 carries the header too
        app.add_middleware(_RequestIdMiddleware)
    _install_error_handlers(app)
    handler = _Handlers(aengine, model_name, metrics, options)

    async def tracked(serve: Callable[[], Any]) -> Response:
        """vLLM's server load: a generation request counts from its arrival until its response is sent. The count
        changes only on the event loop (an async background task runs there; a sync one would run on a worker)."""
        if not options.enable_server_load_tracking:
            return await serve()

        async def done() -> None:
            app.state.server_load_metrics -= 1

        app.state.server_load_metrics += 1
        try:
            response = await serve()
        except BaseException:
            await done()
            raise
        assert response.background is None, "no response of ours has a background task of its own"
        response.background = BackgroundTask(done)
        return response

    @app.get("/health")
    async def health() -> Response:
        if not aengine.is_running:  # stopping, stopped, or broken (dead_reason says why)
            reason = aengine.dead_reason or "the engine loop is not running"
            return _error_response(ErrorInfo(503, reason, type="server_error"))
        return Response(status_code=200)

    @app.get("/ping")
    @app.post("/ping")
    async def ping() -> Response:  # SageMaker's health check
        return await health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/load")
    async def load() -> dict[str, int]:
        return {"server_load": app.state.server_load_metrics}

    if options.enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def tokenizer_info() -> Response:
            return JSONResponse(handler.tokenizer_info())

    if options.server_dev_mode:
        @app.post("/sleep")
        async def sleep(request: Request) -> Response:
            """vLLM's dev-mode sleep: ?level= (default 1) and ?mode= (default abort); 200 once the engine sleeps."""
            level = _int_query(request, "level", "1")
            mode = request.query_params.get("mode", "abort")
            if level >= 1 and not options.enable_sleep_mode:
                raise APIError(ErrorInfo(400, f"sleep level {level} frees the KV cache, which needs the server "
                                              "started with --enable-sleep-mode; level 0 (pause) works without it.",
                                         param="level"))
            await _engine_call(aengine.sleep(level, mode), "level")
            return Response(status_code=200)

        @app.post("/wake_up")
        async def wake_up(request: Request) -> Response:
            """vLLM's: ?tags=weights&tags=kv_cache wakes those parts; no tags wakes everything."""
            await _engine_call(aengine.wake_up(request.query_params.getlist("tags") or None), "tags")
            return Response(status_code=200)

        @app.get("/is_sleeping")
        async def is_sleeping() -> dict[str, bool]:
            return {"is_sleeping": aengine.is_sleeping}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [handler.model_card()]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return await handler.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return await handler.detokenize(body)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await tracked(lambda: handler.completions(body, request))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await tracked(lambda: handler.chat(body, request))

    @app.post("/v1/chat/completions/batch")
    async def batch_chat_completions(request: Request) -> Response:
        """vLLM's batched chat: `messages` is a list of conversations; the other fields are a chat request's."""
        body = await _json_object(request)
        return await tracked(lambda: handler.batch_chat(body, request))

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        """SageMaker's one endpoint: a body with "messages" is a chat completion, one with "prompt" a completion."""
        body = await _json_object(request)
        kind = ChatCompletionRequest if "messages" in body else CompletionRequest if "prompt" in body else None
        if kind is None:
            raise APIError(ErrorInfo(400, "Cannot find suitable handler for request. Expected one of: "
                                          f"{_INVOCATION_TYPES} (a body with 'messages' or 'prompt')."))
        try:
            parsed = kind.model_validate_json(await request.body())  # as FastAPI parses the routes' bodies
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        serve = handler.chat if kind is ChatCompletionRequest else handler.completions
        return await tracked(lambda: serve(parsed, request))

    return app


def _int_query(request: Request, name: str, default: str) -> int:
    value = request.query_params.get(name, default)
    try:
        return int(value)
    except ValueError:
        raise APIError(ErrorInfo(400, f"query parameter {name}={value!r} is not an integer.", param=name)) from None


async def _engine_call(call: Any, param: str) -> None:
    """Await a sleep or wake-up: RequestError is a 400 naming `param`, a stopped engine a 503."""
    try:
        await call
    except RequestError as e:
        raise APIError(ErrorInfo(400, str(e), param=param)) from None
    except EngineDeadError as e:
        raise APIError(ErrorInfo(503, str(e), type="server_error")) from None


async def _json_object(request: Request) -> dict[str, Any]:
    """The body of a request that FastAPI does not parse, held to the same rules as the routes' bodies."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":  # vLLM's status and message for /invocations
        raise APIError(ErrorInfo(415, "Unsupported Media Type: Only 'application/json' is allowed"))
    try:
        body = json.loads(await request.body())
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise APIError(ErrorInfo(400, "the request body is not valid JSON; send a JSON object.")) from None
    if not isinstance(body, dict):
        raise APIError(ErrorInfo(400, "the request body is not a JSON object; send a JSON object."))
    return body


class _Handlers:
    """The generation endpoints, sharing one engine and its metrics."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, metrics: ServingMetrics,
                 options: ServerOptions = ServerOptions()) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.options = options
        self.created = int(time.time())
        # An unknown name is a ConfigError here, at start-up, not on the first request.
        self.reasoning_parser = get_reasoning_parser(options.reasoning_parser) if options.reasoning_parser else None
        self.tool_parser = check_tool_options(options.enable_auto_tool_choice, options.tool_call_parser)
        if options.tool_call_id_type not in TOOL_CALL_ID_TYPES:
            raise ConfigError(f"tool_call_id_type {options.tool_call_id_type!r} is not one of {TOOL_CALL_ID_TYPES}.")
        # vLLM's adjust_request: a parser whose markers the tokenizer makes special decodes with them kept.
        self.tool_parser_keeps_special = (self.tool_parser is not None
                                          and self.tool_parser.needs_special_tokens(engine.tokenizer))
        # The ids of the reasoning tags: a reasoning reply's grammar holds after the end tag; a model that opens its
        # reasoning itself writes the start tag first (Qwen3's and DeepSeek-R1's tags are one special token each).
        self.reasoning_tag_ids: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        if self.reasoning_parser is not None and engine.tokenizer is not None:
            self.reasoning_tag_ids = tuple(tuple(engine.tokenizer.encode(tag, add_special_tokens=False))
                                           for tag in (THINK_START, THINK_END))

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's /tokenizer_info: the tokenizer's init kwargs (file paths left out, special tokens as their text),
        its class name as tokenizer_class, and the chat template."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise APIError(ErrorInfo(404, "this plan has no tokenizer files."))
        config = {k: v for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
                  if k not in ("vocab_file", "merges_file")}
        # AddedToken objects become their text (vLLM's rule); anything else JSON cannot hold, its str().
        config = json.loads(json.dumps(config, default=lambda o: o.content if hasattr(o, "content") else str(o)))
        config["tokenizer_class"] = type(tokenizer).__name__
        if isinstance(getattr(tokenizer, "chat_template", None), str):
            config["chat_template"] = tokenizer.chat_template
        return config

    def _render_options(self, body: CompletionRequest | ChatCompletionRequest) -> RenderOptions:
        as_ids = body.return_tokens_as_token_ids
        continuous = body.stream and body.usage_options(self.options.enable_force_include_usage)[1]
        return RenderOptions(return_token_ids=bool(body.return_token_ids),
                             tokens_as_token_ids=self.options.return_tokens_as_token_ids if as_ids is None else as_ids,
                             continuous_usage=continuous)

    def model_card(self) -> dict[str, Any]:
        """vLLM's ModelCard: root is the served model (vLLM's is the model path; trtopt serves one plan under one
        name), no parent, and one permission entry with vLLM's values."""
        permission = {"id": f"modelperm-{self.model_name}", "object": "model_permission", "created": self.created,
                      "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                      "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                      "organization": "*", "group": None, "is_blocking": False}
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "trtopt",
                "root": self.model_name, "parent": None, "max_model_len": self.engine.max_model_len,
                "permission": [permission]}

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's /tokenize: {"count", "max_model_len", "tokens", "token_strs"} (token_strs when asked for)."""
        self._check_model(body.model)
        try:
            _, ids = await anyio.to_thread.run_sync(self.engine.tokenize, body.engine_prompt())
        except RequestError as e:
            raise APIError(ErrorInfo(400, str(e))) from None
        strs = self.engine.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        """vLLM's /detokenize: {"prompt": text}. Ids outside the vocabulary are a 400."""
        self._check_model(body.model)
        vocab = self.engine.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(ErrorInfo(400, f"token id {bad} is outside the vocabulary [0, {vocab}).", param="tokens"))
        if self.engine.tokenizer is None:
            raise APIError(ErrorInfo(400, "this plan has no tokenizer files, so ids cannot be turned into text."))
        return {"prompt": self.engine.tokenizer.decode(body.tokens)}

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(ErrorInfo(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}.",
                                     param="model", code="model_not_found"))

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        beam = body.to_beam_search_params if body.use_beam_search else None

        def prepare() -> list[PreparedRequest]:
            params = body.prepare_params(body.max_tokens) if beam else body.to_sampling_params()
            return self.engine.prepare_batch(body.prompts(), params)

        renderer = CompletionRenderer(f"cmpl-{uuid.uuid4().hex}", self.model_name, self.engine.tokenizer, n=body.n,
                                      echo=body.echo, logprobs=body.logprobs is not None,
                                      prompt_logprobs=body.prompt_logprobs is not None, best_of=body.best_of,
                                      options=self._render_options(body))
        return await self._serve("completions", body, request, prepare, renderer, beam=beam,
                                 beam_logprobs=body.logprobs)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        auto_tools = self.tool_parser is not None and is_auto_tool_choice(body.tools, body.tool_choice)
        self._refuse_untrusted_template(body, "chat")
        try:
            tool_plan = body.tool_plan(auto_tool_choice=self.tool_parser is not None)
        except RequestError as e:
            self.metrics.requests.labels("chat", "rejected").inc()
            raise APIError(ErrorInfo(400, str(e), param="tool_choice")) from None
        reasoning = self._reasoning_rule(body)
        beam = ((lambda: body.to_beam_search_params(auto_tool_choice=self.tool_parser is not None))
                if body.use_beam_search else None)

        def prepare() -> list[PreparedRequest]:
            if beam:
                return [self.engine.prepare(body.template_messages(), body.prepare_params(body.max_output_tokens))]
            return [self._prepare_chat(body, reasoning, keep_special=auto_tools and self.tool_parser_keeps_special)]

        # Kimi-K2's ids number every call of the conversation: the earlier replies' calls come first (vLLM's).
        kimi_index = (sum(len(m.tool_calls or ()) for m in body.messages if m.role == "assistant")
                      if self.options.tool_call_id_type == "kimi_k2" else None)
        renderer = ChatRenderer(f"chatcmpl-{uuid.uuid4().hex}", self.model_name, self.engine.tokenizer,
                                n=body.n, top_logprobs=body.top_logprobs or 0, tool_plan=tool_plan,
                                role=body.response_role, echo_text=body.echo_text(),
                                reasoning=reasoning, options=self._render_options(body),
                                tool_parser=self.tool_parser if auto_tools else None, kimi_call_index=kimi_index)
        return await self._serve("chat", body, request, prepare, renderer, beam=beam, beam_logprobs=body.num_logprobs)

    async def batch_chat(self, raw: dict[str, Any], request: Request) -> Response:
        """vLLM's /v1/chat/completions/batch: each conversation of `messages` is a chat request with the body's
        other fields, all added to the engine at once (one continuous batch); its reply is choice k (k = its place
        in `messages`). Not streamed; no tools, n, prompt_logprobs or beam search (vLLM's limits)."""
        bodies = _batch_bodies(raw)
        first = bodies[0]  # the fields all conversations share: model, sampling, chat_template_kwargs
        self._refuse_untrusted_template(first, "chat_batch")
        reasoning = self._reasoning_rule(first)

        def prepare() -> list[PreparedRequest]:
            return [self._prepare_chat(body, reasoning) for body in bodies]

        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        parts = [ChatRenderer(request_id, self.model_name, self.engine.tokenizer, top_logprobs=body.top_logprobs or 0,
                              role=body.response_role, echo_text=body.echo_text(), reasoning=reasoning,
                              options=self._render_options(body)) for body in bodies]
        return await self._serve("chat_batch", first, request, prepare, BatchChatRenderer(parts))

    def _refuse_untrusted_template(self, body: ChatCompletionRequest, endpoint: str) -> None:
        kwargs_template = (body.chat_template_kwargs or {}).get("chat_template")
        if not self.options.trust_request_chat_template and (body.chat_template, kwargs_template) != (None, None):
            self.metrics.requests.labels(endpoint, "rejected").inc()
            message = ("Chat template is passed with request, but --trust-request-chat-template is not set. "
                       "Refused request with untrusted chat template.")  # vLLM's
            raise APIError(ErrorInfo(400, message, param="chat_template"))

    def _reasoning_rule(self, body: ChatCompletionRequest) -> ReasoningRule | None:
        """How this request's replies split into reasoning and content (None without --reasoning-parser)."""
        return self.reasoning_parser.rule(body.chat_template_kwargs) if self.reasoning_parser is not None else None

    def _prepare_chat(self, body: ChatCompletionRequest, reasoning: ReasoningRule | None, *,
                      keep_special: bool = False) -> PreparedRequest:
        """One conversation, prepared (on a worker thread). A reply that reasons (`reasoning` enabled) under a
        grammar (response_format, structured_outputs, guided_*, a forced tool call) thinks freely and is constrained
        only from the token after its reasoning end, as vLLM's is_reasoning_end gates its grammar; under a rule
        where the model opens its reasoning itself (qwen3), a reply that does not open with <think> is the
        grammar's from its first token."""
        params = body.to_sampling_params(auto_tool_choice=self.tool_parser is not None)
        if keep_special:  # vLLM's adjust_request: the tool parser's markers are special tokens, kept in the text
            params = dataclasses.replace(params, skip_special_tokens=False)
        prepared = self.engine.prepare(body.template_messages(), params)
        if prepared.grammar is not None and reasoning is not None and reasoning.enabled:
            start, end = self.reasoning_tag_ids
            gated = ReasoningGatedGrammar(prepared.grammar, reasoning_end_ids=end,
                                          reasoning_start_ids=() if reasoning.starts_in_reasoning else start)
            prepared = dataclasses.replace(prepared, grammar=gated)
        return prepared

    async def _serve(self, endpoint: str, body: CompletionRequest | ChatCompletionRequest, request: Request,
                     prepare: Callable[[], list[PreparedRequest]], renderer: Renderer, *,
                     beam: Callable[[], BeamSearchParams] | None = None, beam_logprobs: int | None = None) -> Response:
        """Prepare the prompts (on a worker thread), run them, and answer (streamed or not). beam: the request's
        beam search params (use_beam_search), made after the model check; then `prepare` only resolves the prompts
        and their output budget, and a BeamSearchStream runs them (beam_logprobs: each token's top-k, or None)."""
        arrival = time.monotonic()
        _warn_unknown_fields(body)
        if body.model is not None and body.model != self.model_name:  # vLLM's: no model is the served one
            self.metrics.requests.labels(endpoint, "rejected").inc()
            raise APIError(ErrorInfo(404, f"the model {body.model!r} does not exist; this server serves "
                                          f"{self.model_name!r} (see GET /v1/models).", param="model",
                                     code="model_not_found"))
        try:
            beam_params = beam() if beam is not None else None
            # Tokenizing (and rendering a chat template) costs up to ~0.3 s for a max-size prompt, compiling a grammar
            # milliseconds to seconds: prepare runs on a worker thread, never on the event loop or the step thread.
            prompts = await anyio.to_thread.run_sync(prepare)
            # Prompt k of a batch runs as engine request "<id>-k"; the renderer maps it back to choices k*n..k*n+n-1.
            ids = [renderer.request_id] if len(prompts) == 1 else [f"{renderer.request_id}-{k}" for k in range(len(prompts))]
            if beam_params is None:
                stream: RequestStream | BeamSearchStream = await self.engine.add_requests(list(zip(ids, prompts)))
            else:
                stream = BeamSearchStream(self.engine, list(zip(ids, prompts)), beam_params, logprobs=beam_logprobs)
        except RequestError as e:
            self.metrics.requests.labels(endpoint, "rejected").inc()
            raise APIError(ErrorInfo(400, str(e))) from None
        except EngineDeadError as e:
            raise APIError(ErrorInfo(503, str(e), type="server_error")) from None
        tracker = LatencyTracker(self.metrics, arrival)
        prompt_index = {rid: k for k, rid in enumerate(ids)}
        if body.stream:
            include_usage, _ = body.usage_options(self.options.enable_force_include_usage)
            sse = self._sse(endpoint, stream, prompt_index, renderer, tracker,
                            [p.prompt_token_ids for p in prompts], include_usage)
            return _SSEResponse(sse, media_type="text/event-stream")
        return await self._collect(endpoint, stream, prompt_index, renderer, tracker, request)

    async def _collect(self, endpoint: str, stream: RequestStream | BeamSearchStream, prompt_index: dict[str, int],
                       renderer: Renderer,
                       tracker: LatencyTracker, request: Request) -> Response:
        """Wait for every prompt to finish, while watching the connection: a client that leaves has its requests
        aborted at once (not when the next output arrives, which may be many seconds later)."""
        finals: dict[int, RequestOutput] = {}
        left = False
        error: Exception | None = None

        async def collect(scope: anyio.CancelScope) -> None:
            nonlocal error
            try:
                async for out in stream:
                    tracker.on_tokens(time.monotonic(), sum(len(c.delta_token_ids) for c in out.outputs))
                    if out.finished:
                        finals[prompt_index[out.request_id]] = out
            except Exception as e:  # re-raised below, outside the task group (which would wrap it in a group)
                error = e
            scope.cancel()

        async def watch(scope: anyio.CancelScope) -> None:
            nonlocal left
            await _wait_for_disconnect(request)
            left = True
            scope.cancel()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(collect, tg.cancel_scope)
                tg.start_soon(watch, tg.cancel_scope)
            if error is not None:
                raise error
        except (EngineDeadError, RequestAbortedError) as e:  # shutting down or put to sleep mid-request
            raise APIError(ErrorInfo(503, str(e), type="server_error")) from None
        except RuntimeError as e:  # the model failed on a step of this request (the engine freed its blocks)
            self.metrics.requests.labels(endpoint, "error").inc()
            raise APIError(ErrorInfo(500, str(e), type="server_error")) from None
        finally:
            stream.close()  # aborts whatever has not finished (all of it, if the client left)
        if left:
            self.metrics.requests.labels(endpoint, "disconnected").inc()
            return Response(status_code=499)
        assert len(finals) == len(prompt_index), "a stream ends when every prompt has finished"
        outs = [finals[k] for k in range(len(finals))]
        tracker.on_finish(time.monotonic(), outs)
        self.metrics.requests.labels(endpoint, _outcome(outs)).inc()
        # vLLM's ORCA load report, read after the request finished (streams carry none: their headers went first).
        load = orca_headers(request.headers.get(ORCA_FORMAT_HEADER), self.engine.stats)
        return JSONResponse(renderer.full_response(outs), headers=load)

    async def _sse(self, endpoint: str, stream: RequestStream | BeamSearchStream, prompt_index: dict[str, int],
                   renderer: Renderer,
                   tracker: LatencyTracker, prompt_token_ids: list[list[int]],
                   include_usage: bool) -> AsyncIterator[str]:
        outcome = "disconnected"  # unless the loop below completes: a cancelled generator is a client that left
        completion_tokens: dict[str, int] = {}
        finals: list[RequestOutput] = []
        try:
            for chunk in renderer.stream_start(prompt_token_ids):
                yield _sse_event(chunk)
            async for out in stream:
                tracker.on_tokens(time.monotonic(), sum(len(c.delta_token_ids) for c in out.outputs))
                for chunk in renderer.stream_chunks(out, prompt_index[out.request_id]):
                    yield _sse_event(chunk)
                completion_tokens[out.request_id] = sum(len(c.token_ids) for c in out.outputs)
                if out.finished:
                    finals.append(out)
            outcome = _outcome(finals)
            tracker.on_finish(time.monotonic(), finals)
            if include_usage:
                num_prompt_tokens = sum(len(ids) for ids in prompt_token_ids)
                yield _sse_event(renderer.usage_chunk(usage(num_prompt_tokens, sum(completion_tokens.values()))))
            yield "data: [DONE]\n\n"
        except RuntimeError as e:  # the model failed mid-stream: headers are sent, so the error goes in-band
            outcome = "error"
            status = 503 if isinstance(e, RequestAbortedError) else 500
            yield _sse_event(ErrorInfo(status, str(e), type="server_error").body())
            yield "data: [DONE]\n\n"
        finally:
            stream.close()
            self.metrics.requests.labels(endpoint, outcome).inc()


def _outcome(outs: list[RequestOutput]) -> str:
    reasons = {c.finish_reason for out in outs for c in out.outputs}
    return "error" if "error" in reasons else "ok"


async def _wait_for_disconnect(request: Request) -> None:
    """Return when the client has gone. The body was read already, so the next ASGI message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _batch_bodies(raw: dict[str, Any]) -> list[ChatCompletionRequest]:
    """The chat requests of a /v1/chat/completions/batch body, one per conversation, each checked as the chat route
    checks its body (a bad field is a 400 whose param names the conversation: messages.1.0.content)."""
    conversations = raw.get("messages")
    if not (isinstance(conversations, list) and conversations and all(isinstance(c, list) for c in conversations)):
        raise APIError(ErrorInfo(400, "messages must be a non-empty list of conversations, each a list of messages: "
                                      "[[{'role': 'user', 'content': ...}], ...].", param="messages"))
    if raw.get("use_beam_search"):  # vLLM's message
        raise APIError(ErrorInfo(400, "Batch chat completions do not support beam search. Please set "
                                      "`use_beam_search` to False.", param="use_beam_search"))
    bodies = []
    for k, conversation in enumerate(conversations):
        try:
            body = ChatCompletionRequest.model_validate_json(json.dumps({**raw, "messages": conversation}))
        except ValidationError as e:
            errors = [{**err, "loc": _conversation_loc(err["loc"], k)} for err in e.errors()]
            raise RequestValidationError(errors) from None
        bodies.append(body)
    first = bodies[0]
    unsupported = {"stream": first.stream, "n": first.n != 1, "tools": bool(first.tools),
                   "tool_choice": first.tool_choice is not None, "prompt_logprobs": first.prompt_logprobs is not None}
    refused = [name for name, bad in unsupported.items() if bad]
    if refused:
        raise APIError(ErrorInfo(400, f"the batch endpoint does not support {refused[0]} (vLLM's limits: no streaming, "
                                      "n = 1, no tools, no prompt_logprobs); send such conversations to "
                                      "/v1/chat/completions one by one.", param=refused[0]))
    return bodies


def _conversation_loc(loc: tuple, k: int) -> tuple:
    """A chat body's error location inside conversation k of a batch: messages.0.content -> messages.k.0.content."""
    return ("messages", k, *loc[1:]) if loc[:1] == ("messages",) else loc


_warned_fields: set[str] = set()


def _warn_unknown_fields(body: CompletionRequest | ChatCompletionRequest) -> None:
    """vLLM's policy: unknown fields are ignored, with a warning (here once per field name, so a client that
    always sends one cannot flood the log)."""
    new = sorted(set(body.model_extra or ()) - _warned_fields)
    if new:
        _warned_fields.update(new)
        log.warning("ignoring unknown request fields %s (first seen; not logged again)", [ascii(f) for f in new])


def _sse_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _ASCIIJSONResponse(JSONResponse):
    """Error bodies may quote user input; ASCII escapes keep even a lone surrogate sendable."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _error_response(info: ErrorInfo) -> JSONResponse:
    return _ASCIIJSONResponse(info.body(), status_code=info.status)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc.info)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return _error_response(ErrorInfo(400, "the request body is not valid JSON; send a JSON object."))
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        msg = f"invalid request: {param or 'body'}: {first.get('msg', 'invalid value')}"
        return _error_response(ErrorInfo(400, msg, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error_response(ErrorInfo(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        # The last tier: a bug of ours, never the client's input (that is a 4xx above). The id ties the
        # client's report to the logged traceback.
        error_id = uuid.uuid4().hex[:12]
        log.error("unexpected error %s on %s %s", error_id, request.method, request.url.path, exc_info=exc)
        return _error_response(ErrorInfo(500, f"internal server error (error id {error_id}); the server logged it.",
                                         type="server_error", code=error_id))


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that always watches for the client leaving and always closes its generator, so an
    abandoned stream aborts its request at once (whatever ASGI spec version the server speaks)."""

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream_then_stop() -> None:
                    with contextlib.suppress(OSError):  # the socket went away mid-send
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream_then_stop)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()
            if self.background is not None:  # the load tracker's decrement: after the stream, however it ended
                await self.background()


class _AuthMiddleware:
    """401 for a protected path without `Authorization: Bearer <api_key>`, before the body is received or parsed
    (so an unauthenticated client learns nothing about validation, and costs nothing)."""

    def __init__(self, app: Any, api_key: str, protected: tuple[str, ...]) -> None:
        self.app = app
        self.api_key = api_key.encode()
        self.protected = protected

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        # The route path, as Starlette matches it: with a root_path, /llm/v1/... is /v1/... and must be guarded too.
        if scope["type"] == "http" and _route_path(scope).startswith(self.protected) and not self._authorized(scope):
            info = ErrorInfo(401, "missing or wrong API key; send `Authorization: Bearer <key>`.", code="invalid_api_key")
            return await _error_response(info)(scope, receive, send)
        await self.app(scope, receive, send)

    def _authorized(self, scope: dict) -> bool:
        given = dict(scope.get("headers") or ()).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.api_key)


class _RequestIdMiddleware:
    """vLLM's --enable-request-id-headers: each HTTP response carries `X-Request-Id`, the request's own X-Request-Id
    header when it sent one, else a new uuid4 in hex (32 characters)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent = next((v for k, v in scope.get("headers") or () if k == b"x-request-id"), None)
        request_id = sent if sent is not None else uuid.uuid4().hex.encode()

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class _BodyLimitMiddleware:
    """Answers 413 for request bodies over max_body_bytes, before the app parses them. The body is read here
    (bounded by the limit) and replayed to the app; later receives (disconnect notices) pass straight through."""

    def __init__(self, app: Any, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return await self._reject(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending its body
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:  # a chunked body, with no content-length to check up front
                return await self._reject(scope, receive, send)
            if not message.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replaying_receive() -> dict:
            return replay.pop() if replay else await receive()

        await self.app(scope, replaying_receive, send)

    async def _reject(self, scope: dict, receive: Callable, send: Callable) -> None:
        info = ErrorInfo(413, f"the request body is larger than {self.max_body_bytes} bytes; send a shorter prompt.")
        await _error_response(info)(scope, receive, send)


DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0


def run_server(config: Any, aengine: AsyncLLMEngine, *, shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> str | None:
    """Run uvicorn (a uvicorn.Config over an app of `aengine`) until it exits, or until the engine breaks: then
    the server shuts down too, so a supervisor can restart the process. Returns the engine's dead_reason (None
    after a clean shutdown); `trtopt serve` exits non-zero on it.

    Shutdown (SIGTERM, SIGINT, or a broken engine) takes at most about `shutdown_timeout` seconds: the engine loop
    is stopped at once, which ends every in-flight request (streams get an error event and [DONE], waiting
    requests a 503), so connections close by themselves; uvicorn waits at most half the budget for them, and the
    lifespan's final stop joins the step thread for at most the other half.
    """
    import threading

    import uvicorn

    half = shutdown_timeout / 2
    config.timeout_graceful_shutdown = max(1, round(half))  # uvicorn takes whole seconds
    config.app.state.stop_timeout = half

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            # A signal handler must not block: the stop (a bounded join) runs on its own thread.
            threading.Thread(target=aengine.stop, args=(half,), name="trtopt-shutdown", daemon=True).start()

    server = Server(config)

    def exit_when_dead() -> None:
        aengine.loop.stopped.wait()
        if aengine.dead_reason is not None:
            server.should_exit = True  # uvicorn polls it: a graceful shutdown, as on SIGTERM

    threading.Thread(target=exit_when_dead, name="trtopt-engine-watch", daemon=True).start()
    server.run()
    return aengine.dead_reason


def _route_path(scope: dict) -> str:
    """The path the router matches: scope["path"] without the --root-path prefix (Starlette's rule; its own helper
    is private)."""
    path, root = scope["path"], scope.get("root_path", "")
    if not root or not path.startswith(root):
        return path
    if path == root:
        return ""
    return path[len(root):] if path[len(root)] == "/" else path

"""An OpenAI-compatible HTTP API over one model (Starlette on uvicorn).

POST /v1/chat/completions, POST /v1/completions (server-sent events when "stream" is true, ending
in `data: [DONE]`), GET /v1/models, GET /health (503 while the model loads). Requests queue for the
single model: one generation runs at a time, on a worker thread; a client that disconnects stops
its generation. Meant for one user on loopback, not for production serving.
"""

import asyncio
import json
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .chat import render_messages
from .generate import GenerateOptions, Session
from .model import RuntimeOptions
from .sample import SamplerConfig


@dataclass(frozen=True)
class ServerOptions:
    runtime: RuntimeOptions = field(default_factory=RuntimeOptions)
    api_key: str | None = None
    model_id: str | None = None          # default: the file's stem
    max_body_bytes: int = 1 << 20
    max_tokens_limit: int = 4096         # largest max_tokens a request may ask for
    body_seconds: float = 30.0           # a request body must arrive within this
    chat_template: str | None = None


class BadRequest(Exception):
    def __init__(self, message, status=400, code=None):
        super().__init__(message)
        self.status, self.code = status, code


# Request fields that would change the result and that pinfer does not implement: refused, by name.
UNSUPPORTED = {
    "n": lambda v: v not in (None, 1),
    "best_of": lambda v: v not in (None, 1),
    "logprobs": lambda v: v not in (None, False, 0),
    "top_logprobs": lambda v: v not in (None, 0),
    "echo": lambda v: bool(v),
    "suffix": lambda v: v not in (None, ""),
    "tools": lambda v: bool(v),
    "functions": lambda v: bool(v),
    "response_format": lambda v: v not in (None, {"type": "text"}),
    "presence_penalty": lambda v: v not in (None, 0, 0.0),
    "frequency_penalty": lambda v: v not in (None, 0, 0.0),
    "logit_bias": lambda v: bool(v),
}


class StopMatcher:
    """Cuts generated text at the first stop string, holding back a possible partial match."""

    def __init__(self, stops):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text):
        """(text safe to emit, stopped)"""
        self.pending += text
        for s in self.stops:
            i = self.pending.find(s)
            if i >= 0:
                out, self.pending = self.pending[:i], ""
                return out, True
        keep = max((self._held(s) for s in self.stops), default=0)
        out = self.pending[:len(self.pending) - keep]
        self.pending = self.pending[len(out):]
        return out, False

    def _held(self, stop):
        """Length of the longest end of the pending text that begins `stop` (and may complete it
        later): only positions holding stop's first character are tried, and only the last
        len(stop) - 1 of them, so a long stop string costs what the pending text costs."""
        p = self.pending
        i = p.find(stop[0], max(0, len(p) - len(stop) + 1))
        while i >= 0:
            if stop.startswith(p[i:]):
                return len(p) - i
            i = p.find(stop[0], i + 1)
        return 0

    def flush(self):
        out, self.pending = self.pending, ""
        return out


class Engine:
    """The model, loaded in the background, a one-thread executor that serializes generations and
    one that renders and tokenizes prompts, so that neither blocks the event loop (/health)."""

    def __init__(self, path, options, on_load_error=None, on_loaded=None):
        self.path, self.options = path, options
        self.on_loaded = on_loaded
        self.session = None
        self.error = None
        self.ready = threading.Event()
        self.lock = asyncio.Lock()
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pinfer-gen")
        self.prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pinfer-prompt")
        self.on_load_error = on_load_error
        self.closing = threading.Event()   # set by close(): every generation stops at its next token
        self.pool.submit(self._load)

    def close(self):
        """Stop every generation at its next token (the server is shutting down): streams end and
        the process can exit within a token's time, not after the longest response."""
        self.closing.set()

    def _load(self):
        try:
            self.session = Session(self.path, self.options.runtime)
            if self.on_loaded is not None:
                self.on_loaded(self.session.model)
        except Exception as e:  # reported by /health and every request, or on_load_error
            self.error = e
            if self.on_load_error is not None:
                self.on_load_error(e)
        finally:
            self.ready.set()

    async def stream(self, prompt_ids, gen, stops, cancelled, usage):
        """Yield (text, finish_reason or None) while generating, counting tokens into `usage`."""
        loop = asyncio.get_running_loop()
        queue = asyncio.Queue()
        matcher = StopMatcher(stops)
        usage.update(prompt_tokens=len(prompt_ids), completion_tokens=0, total_tokens=len(prompt_ids))

        def work():
            try:
                n = 0
                stop = lambda: cancelled.is_set() or self.closing.is_set()     # noqa: E731
                for step in self.session.generate(prompt_ids, gen, should_stop=stop):
                    n += 1
                    text, stopped = matcher.feed(step.text)
                    reason = "stop" if stopped else step.finish_reason
                    if reason and not stopped:
                        text += matcher.flush()
                    loop.call_soon_threadsafe(queue.put_nowait, (text, reason, n))
                    if stopped:
                        break
            except Exception as e:
                loop.call_soon_threadsafe(queue.put_nowait, e)
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, None)

        async with self.lock:
            fut = loop.run_in_executor(self.pool, work)
            try:
                while (item := await queue.get()) is not None:
                    if isinstance(item, Exception):
                        raise item
                    text, reason, n = item
                    usage.update(completion_tokens=n, total_tokens=len(prompt_ids) + n)
                    yield text, reason
            finally:
                cancelled.set()
                await fut


def _error(message, status=400, code=None):
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 401:
        kind = "authentication_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}},
                        status_code=status)


def _text(value, field):
    """A request string, checked: a lone surrogate (JSON allows "\\udfff") is not text any
    tokenizer can take."""
    if not isinstance(value, str):
        raise BadRequest(f"'{field}' must be a string, not {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(f"'{field}' holds a lone surrogate (U+{ord(value[e.start]):04X}), which is not "
                         "valid Unicode text") from None
    return value


def _content(m, i):
    """A message's content as text: a string, null, or a list of {"type": "text", "text": ...}."""
    content = m.get("content")
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            where = f"messages[{i}].content[{k}]"
            if not isinstance(part, dict) or part.get("type", "text") != "text":
                raise BadRequest(f"'{where}' must be a text part, {{\"type\": \"text\", \"text\": ...}}; "
                                 "pinfer reads text only")
            parts.append(_text(part.get("text"), where + ".text"))
        return "".join(parts)
    return _text(content, f"messages[{i}].content")


def _flag(data, key):
    v = data.get(key)
    if v is not None and not isinstance(v, bool):
        raise BadRequest(f"'{key}' must be true or false, not {json.dumps(v)[:40]}")
    return bool(v)


def _number(data, key, default, lo, hi, kind=float):
    v = data.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi or \
            kind is int and v != int(v):
        raise BadRequest(f"'{key}' must be a {'whole ' if kind is int else ''}number from {lo} to {hi}")
    return kind(v)


class _Api:
    """The endpoints over one Engine: requests checked field by field, prompts prepared off the
    event loop, completions streamed or whole."""

    def __init__(self, engine, options, model_id):
        self.engine, self.options, self.model_id = engine, options, model_id
        self.created = int(time.time())

    def check_auth(self, request):
        if self.options.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
        # RFC 7235: the scheme is case-insensitive
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.options.api_key.encode()):
            raise BadRequest("a valid API key is required: send 'Authorization: Bearer KEY'", 401)

    def check_ready(self):
        if not self.engine.ready.is_set():
            raise BadRequest("the model is still loading; retry in a moment", 503)
        if self.engine.error is not None:
            raise BadRequest(f"the model failed to load: {self.engine.error}", 500)

    async def read_json(self, request):
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.options.max_body_bytes):
            raise BadRequest(f"the request body is {length} bytes, over the limit of {self.options.max_body_bytes}", 413)
        async def collect():
            body = b""
            async for chunk in request.stream():     # ClientDisconnect if the client goes away
                body += chunk
                if len(body) > self.options.max_body_bytes:
                    raise BadRequest(f"the request body is over the limit of {self.options.max_body_bytes} bytes", 413)
            return body
        try:
            body = await asyncio.wait_for(collect(), self.options.body_seconds)
        except asyncio.TimeoutError:
            raise BadRequest(f"the request body did not arrive within {self.options.body_seconds:g} s", 408) from None
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"the request body is not valid JSON ({e.msg if hasattr(e, 'msg') else e})") from None
        except RecursionError:
            raise BadRequest("the request body is JSON nested too deeply") from None
        if not isinstance(data, dict):
            raise BadRequest("the request body must be a JSON object")
        bad = [k for k, rule in UNSUPPORTED.items() if k in data and rule(data[k])]
        if bad:
            raise BadRequest(f"pinfer does not support these request fields: {', '.join(bad)}")
        return data

    def generation(self, data, n_prompt):
        room = self.engine.session.n_ctx - n_prompt
        if room <= 0:
            raise BadRequest(f"the prompt is {n_prompt} tokens; the context holds {self.engine.session.n_ctx}",
                             code="context_length_exceeded")
        limit = self.options.max_tokens_limit
        key = "max_completion_tokens" if "max_completion_tokens" in data else "max_tokens"
        max_tokens = _number(data, key, min(limit, room), 1, limit, int)
        seed = _number(data, "seed", -1, -(2 ** 63), 2 ** 64, int)
        sampler = SamplerConfig(temp=_number(data, "temperature", 1.0, 0, 2), top_p=_number(data, "top_p", 1.0, 0, 1),
                                top_k=0, min_p=0.0, repeat_penalty=1.0, seed=seed if seed >= 0 else -1)
        stop = data.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) for s in stop):
            raise BadRequest("'stop' must be a string or a list of up to 4 strings")
        stop = [_text(s, "stop") for s in stop]
        # every request prefills its prompt afresh: a cached prefix computed by another request
        # would round differently, and identical requests must give identical output
        return GenerateOptions(n_predict=min(max_tokens, room), sampler=sampler, reuse_cache=False,
                               ignore_eos=_flag(data, "ignore_eos")), stop      # ignore_eos: as llama.cpp's server

    def prompt_of(self, data, chat):
        """Token ids of the request's prompt (run on self.engine.prep: templates and tokenizers take time)."""
        tok = self.engine.session.tokenizer
        if chat:
            messages = data.get("messages")
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
                raise BadRequest("'messages' must be a non-empty list of {role, content} objects")
            messages = [{**m, "role": _text(m["role"], f"messages[{i}].role"), "content": _content(m, i)}
                        for i, m in enumerate(messages)]
            return tok.encode(render_messages(self.engine.session, messages, self.options.chat_template))
        prompt = data.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise BadRequest("'prompt' must be a string")
        return tok.encode(_text(prompt, "prompt"))

    async def handle(self, request, chat):
        try:
            self.check_auth(request)
            data = await self.read_json(request)
            self.check_ready()
            stream = _flag(data, "stream")
            stream_options = data.get("stream_options")
            if stream_options is not None and not isinstance(stream_options, dict):
                raise BadRequest("'stream_options' must be an object, e.g. {\"include_usage\": true}")
            include_usage = _flag(stream_options or {}, "include_usage")
            prompt_ids = await asyncio.get_running_loop().run_in_executor(self.engine.prep, self.prompt_of, data, chat)
            gen, stops = self.generation(data, len(prompt_ids))
        except BadRequest as e:
            return _error(str(e), e.status, e.code)
        except ClientDisconnect:    # gone while sending its body: nobody to answer, nothing to log
            return Response(status_code=499)
        except ValueError as e:  # a chat template that refuses the conversation, and the like
            return _error(str(e))
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        obj = "chat.completion" if chat else "text_completion"
        cancelled = threading.Event()
        if stream:
            return StreamingResponse(self.sse(rid, obj, chat, prompt_ids, gen, stops, cancelled, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        watcher = asyncio.create_task(self.watch_disconnect(request, cancelled))
        usage = {}
        try:
            parts, reason = [], "length"
            async for text, r in self.engine.stream(prompt_ids, gen, stops, cancelled, usage):
                parts.append(text)
                reason = r or reason
        finally:
            watcher.cancel()
        text = "".join(parts)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
                  if chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": reason})
        return JSONResponse({"id": rid, "object": obj, "created": int(time.time()), "model": self.model_id,
                             "choices": [choice], "usage": usage})

    async def watch_disconnect(self, request, cancelled):
        while not cancelled.is_set():
            if await request.is_disconnected():
                cancelled.set()
                return
            await asyncio.sleep(0.05)

    async def sse(self, rid, obj, chat, prompt_ids, gen, stops, cancelled, include_usage):
        def chunk(delta_or_text, reason, usage_=None):
            base = {"id": rid, "object": obj + (".chunk" if chat else ""), "created": int(time.time()),
                    "model": self.model_id}
            if usage_ is not None:
                base.update(choices=[], usage=usage_)
            elif chat:
                base["choices"] = [{"index": 0, "delta": delta_or_text, "finish_reason": reason}]
            else:
                base["choices"] = [{"index": 0, "text": delta_or_text, "logprobs": None, "finish_reason": reason}]
            return f"data: {json.dumps(base, ensure_ascii=False)}\n\n"

        usage = {}
        try:
            if chat:
                yield chunk({"role": "assistant", "content": ""}, None)
            async for text, reason in self.engine.stream(prompt_ids, gen, stops, cancelled, usage):
                if text:
                    yield chunk({"content": text} if chat else text, None)
                if reason:
                    yield chunk({} if chat else "", reason)
            if include_usage:
                yield chunk(None, None, usage)
            yield "data: [DONE]\n\n"
        finally:
            cancelled.set()   # the client went away, or we finished: either way stop generating

    async def chat_completions(self, request):
        return await self.handle(request, chat=True)

    async def completions(self, request):
        return await self.handle(request, chat=False)

    async def models(self, request):
        try:
            self.check_auth(request)
        except BadRequest as e:
            return _error(str(e), e.status)
        return JSONResponse({"object": "list", "data": [{"id": self.model_id, "object": "model", "created": self.created,
                                                         "owned_by": "pinfer"}]})

    async def health(self, request):
        if not self.engine.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503)
        if self.engine.error is not None:
            return JSONResponse({"status": "error", "message": str(self.engine.error)}, status_code=500)
        return JSONResponse({"status": "ok"})


def make_app(path, options=ServerOptions(), on_load_error=None, on_loaded=None):
    """The Starlette app. on_load_error(exception): called on the loading thread if the model
    fails to load (pinfer serve prints the reason and exits); without it /health says so.
    on_loaded(model): called there once it has loaded (pinfer serve prints its notes)."""
    from pathlib import Path

    engine = Engine(path, options, on_load_error, on_loaded)
    api = _Api(engine, options, options.model_id or Path(path).stem)
    app = Starlette(routes=[
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
    ])
    app.state.engine = engine
    return app

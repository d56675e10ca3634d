"""Running a fanned-out request (fanout_merge.py): one `Job` per flow, each with its own
route, retries and resumed stream as a request of its own has (attempt.py), their
answers merged. A flow that fails after its retries fails the request: an error answer
naming the flow when nothing was sent yet, else an error event and [DONE] ending the
stream; the other flows are cancelled, which aborts their engines' requests.

A prompt is computed once where the engines allow it: a prompt's first choice starts
at once, its other choices once that choice's prefill has succeeded (or its flow has
ended, or it went to an engine that prefills it itself). They are routed only then, so
the policy has seen the first one: a prefix-aware policy sends them to the same prefill,
whose prefix cache now holds the prompt (vLLM caches a request's blocks once computed,
so choices prefilled side by side would each compute it), and the least-loaded decode
policy counts the flows already running."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import orjson

from pdcluster.router import openai
from pdcluster.router.failures import JSON, error
from pdcluster.router.fanout_merge import Flow, StreamMerge, error_message, merge_bodies
from pdcluster.router.http_messages import Request, Response, Stream
from pdcluster.router.relay import SSE_HEADERS

if TYPE_CHECKING:
    from pdcluster.router.attempt import Job
    from pdcluster.router.routing import Route

# A flow's work: route, then run its job.
Start = Callable[[], Awaitable[Response | Stream]]


class _FlowRequest:
    """What a flow's job streams into instead of the client's connection: its sink."""

    __slots__ = ("sink",)

    def __init__(self, sink: _FlowSink):
        self.sink = sink

    def stream(self, status: int = 200, headers: list[tuple[str, str]] | None = None) -> _FlowSink:
        return self.sink


class _FlowSink:
    """A flow's stream as its job writes it: handed to the merge."""

    __slots__ = ("ended", "fan", "k")

    def __init__(self, fan: FanOut, k: int):
        self.fan = fan
        self.k = k
        self.ended = False

    async def write(self, data: bytes) -> None:
        await self.fan.write(self.k, data)

    async def write_eof(self) -> None:
        self.ended = True


class FanOut:
    """One client request run as several flows."""

    def __init__(self, request: Request, flows: list[Flow], response_id: str, stream: bool):
        self.request = request
        self.flows = flows
        self.stream = stream
        self.response_id = response_id
        self.merge = StreamMerge(flows, response_id)
        self.response: Stream | None = None  # the client's, once a flow has sent an event
        self.failure: str | None = None
        self.stopped = asyncio.Event()  # a flow failed, or the client left
        # Per prompt: its first choice's prefill has succeeded, or that flow is over.
        self.prefilled = {flow.prompt: asyncio.Event() for flow in flows}

    def started(self, flow: Flow, job: Job, route: Route) -> None:
        """A flow's job is about to run on `route`: the first choice's tells the others
        when its prompt has been prefilled."""
        if flow.choice != 0:
            return
        if route.prefill is None:
            self.prefilled[flow.prompt].set()  # its engine prefills it: nothing to wait for
        else:
            job.prefilled = self.prefilled[flow.prompt]

    def sink(self, k: int) -> Request:
        """Flow k's request, as its job uses it: `stream()` gives the flow's sink."""
        return _FlowRequest(_FlowSink(self, k))  # type: ignore[return-value]

    async def write(self, k: int, data: bytes) -> None:
        if self.stopped.is_set():
            raise ConnectionResetError("the fanned-out request has ended")
        events, failure = self.merge.feed(k, data)
        if events:
            if self.response is None:
                self.response = self.request.stream(200, SSE_HEADERS)
            try:
                await self.response.write(events)
            except ConnectionResetError:
                self.stopped.set()
                raise
        if failure is not None:
            self.failure = failure
            self.stopped.set()

    async def run(self, starts: list[Start]) -> Response | Stream:
        """The merged answer; the flows still running are cancelled once it is known."""
        flows = zip(self.flows, starts, strict=True)
        tasks = [asyncio.ensure_future(self._flow(flow, start)) for flow, start in flows]
        try:
            return await self._until_done(tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _flow(self, flow: Flow, start: Start) -> Response | Stream:
        prefilled = self.prefilled[flow.prompt]
        if flow.choice != 0:
            await prefilled.wait()
            return await start()
        try:
            return await start()
        finally:
            prefilled.set()

    async def _until_done(self, tasks: list[asyncio.Future[Response | Stream]]) -> Response | Stream:
        answers: dict[int, Response] = {}
        pending = set(tasks)
        stopped = asyncio.ensure_future(self.stopped.wait())
        try:
            while pending:
                await asyncio.wait((*pending, stopped), return_when=asyncio.FIRST_COMPLETED)
                if self.stopped.is_set():
                    return await self.fail(502, self.failure or "the client left")
                for k, task in enumerate(tasks):
                    if task in pending and task.done():
                        pending.discard(task)
                        answer = task.result()
                        if isinstance(answer, Response):
                            if answer.status != 200:
                                message = f"{self.flows[k].label}: {error_message(answer.body)}"
                                extra = [h for h in answer.headers if h[0] != "Content-Type"]
                                return await self.fail(answer.status, message, extra)
                            answers[k] = answer
        finally:
            stopped.cancel()
        return await self._finish(answers)

    async def _finish(self, answers: dict[int, Response]) -> Response | Stream:
        if not self.stream:
            try:
                payloads = [orjson.loads(answers[k].body) for k in range(len(self.flows))]
                merged = merge_bodies(self.flows, payloads, self.response_id)
            except (orjson.JSONDecodeError, AttributeError, TypeError) as e:
                return await self.fail(502, f"an engine's answer is not a completion: {e}")
            return Response(body=orjson.dumps(merged), content_type=JSON)
        unfinished = self.merge.unfinished
        if unfinished:  # a flow's stream was cut short with nothing to resume it
            return await self.fail(502, f"{unfinished[0].label}: the stream ended early")
        if self.response is None:
            self.response = self.request.stream(200, SSE_HEADERS)
        with contextlib.suppress(ConnectionError):
            await self.response.write(self.merge.end())
            await self.response.write_eof()
        return self.response

    async def fail(
        self, status: int, message: str, headers: list[tuple[str, str]] | None = None
    ) -> Response | Stream:
        """The request's error answer (with a flow's own headers, such as Retry-After): an
        error event ending the stream once one started."""
        self.stopped.set()
        message = f"one of the request's {len(self.flows)} flows failed: {message}"
        if self.response is None:
            return error(status, message, headers=headers)
        with contextlib.suppress(ConnectionError):
            await self.response.write(b"data: " + openai.error_body(status, message) + b"\n\n" + b"data: [DONE]\n\n")
            await self.response.write_eof()
        return self.response


"""Request bodies and response shapes of the admin API's model aliases (``/admin/v1/models``): an alias as the API
shows it (its backends without their API keys, its state, what its calls captured, its engines' weight versions),
and the bodies of put, swap, drain and weight updates."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
)

from rollway.admin.schemas import Body
from rollway.store import Backend, ModelAlias
from rollway.store.schemas import UpdatePlan, WeightUpdate


class BackendView(BaseModel):
    backend_id: str
    base_url: str
    kind: str
    model: str
    weight: float
    max_concurrency: int | None
    version: str | None
    has_api_key: bool
    #: For an ``auto`` backend: the engine this server found it to be (``vllm``, ``sglang``, ``openai``); null until
    #: it has been asked. For another kind: that kind.
    detected_kind: str | None = None
    #: Whether the gateway routes calls to it now (False while it is ejected after failures); null when the server
    #: does not say.
    up: bool | None = None

    @classmethod
    def of(
        cls, backend: Backend, detected: dict[str, str] | None = None, up: Callable[[str], bool] | None = None
    ) -> BackendView:
        return cls(
            backend_id=backend.backend_id,
            base_url=backend.base_url,
            kind=backend.kind,
            model=backend.model,
            weight=backend.weight,
            max_concurrency=backend.max_concurrency,
            version=backend.version,
            has_api_key=backend.api_key is not None,
            detected_kind=(detected or {}).get(backend.backend_id) if backend.kind == "auto" else backend.kind,
            up=None if up is None else up(backend.backend_id),
        )


class ModelState(BaseModel):
    paused: bool
    in_flight: int  # calls of the alias in flight in every gateway replica
    in_flight_old: int = 0  # of those, calls still on an earlier configuration (what a swap's drain waits for)
    updating: str | None = None  # the weight update holding the alias (its id), while one is open


class CaptureView(BaseModel):
    """The alias's completions answered by this server since it started, and how many came back without token
    ids (not trainable: an ``openai``-kind backend, or an engine that did not return them)."""

    completions: int = 0
    untrainable: int = 0
    without_logprobs: int = 0  # with token ids, but logprobs missing or not covering every output token


class EngineVersionView(BaseModel):
    """The weight version a backend's engine reports, beside the one Rollway records for its calls: ``match``,
    ``mismatch``, or ``unset`` (the engine's initial ``default``: never given one since it started)."""

    reported: str
    expected: str
    state: Literal["match", "mismatch", "unset"]
    checked_time: float


class ModelView(BaseModel):
    alias: str
    backends: list[BackendView]
    version: str
    sampling: dict[str, Any] | None
    state: ModelState
    capture: CaptureView = CaptureView()
    drained: bool | None = None  # drain, swap with a drain: whether the calls it waited for all ended in time
    #: By backend id, for the engines that report a weight version (vLLM in dev mode, SGLang), as last checked.
    engine_versions: dict[str, EngineVersionView] = {}

    @classmethod
    def of(
        cls,
        model: ModelAlias,
        in_flight: tuple[int, int],
        drained: bool | None = None,
        *,
        detected: dict[str, str] | None = None,
        capture: CaptureView | None = None,
        up: Callable[[str], bool] | None = None,
    ) -> ModelView:
        return cls(
            alias=model.alias,
            capture=capture or CaptureView(),
            backends=[BackendView.of(b, detected, up) for b in model.backends],
            version=model.version,
            sampling=model.sampling,
            state=ModelState(
                paused=model.paused, in_flight=in_flight[0], in_flight_old=in_flight[1], updating=model.update_id
            ),
            drained=drained,
        )


class ModelPage(BaseModel):
    items: list[ModelView]


class ModelPut(Body):
    backends: list[Backend] = Field(min_length=1, max_length=256)
    version: str | None = Field(default=None, min_length=1, max_length=128)
    sampling: dict[str, Any] | None = None


class SwapRequest(Body):
    backends: list[Backend] | None = Field(default=None, min_length=1, max_length=256)
    version: str | None = Field(default=None, min_length=1, max_length=128)
    drain_timeout_seconds: float | None = Field(default=None, ge=0, le=600)


class UpdateRequest(Body):
    """``POST /admin/v1/models/{alias}/updates``: one weight update (``docs/training.md``)."""

    version: str | None = Field(default=None, min_length=1, max_length=128)  # None: the version + 1
    form: Literal["reload", "trainer"] = "reload"  # reload: Rollway reloads the engines; trainer: begin only
    in_flight: Literal["drain", "abort"] = "drain"
    drain_timeout_seconds: float = Field(default=60.0, ge=0, le=3600)
    timeout_seconds: float = Field(default=600.0, gt=0, le=86400)
    weights_path: str | None = Field(default=None, min_length=1, max_length=4096)
    note: str | None = Field(default=None, max_length=1024)

    def plan(self) -> UpdatePlan:
        return UpdatePlan(
            to_version=self.version,
            in_flight=self.in_flight,
            drain_timeout=self.drain_timeout_seconds,
            timeout=self.timeout_seconds,
            weights_path=self.weights_path,
            note=self.note,
        )


class AbortRequest(Body):
    reason: str | None = Field(default=None, max_length=1024)


class UpdatePage(BaseModel):
    items: list[WeightUpdate]


class DrainRequest(Body):
    timeout_seconds: float = Field(default=30.0, ge=0, le=600)

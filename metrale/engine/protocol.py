"""EngineClient: the typed interface the server and the load generator use.

`AsyncEngine` implements it; so do the test doubles (tests/server/fakes.py). Nothing above the engine
reaches into its metrics object, registry, runner or tokenizer: what they need is a method here.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

from metrale.engine.stream import GroupStream, RequestStream
from metrale.outputs import EmbeddingOutput, EngineInfo, EngineState, EngineStats
from metrale.pooling_params import PoolingParams
from metrale.sampling_params import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    """An engine as a service sees it: lifecycle, submission, introspection."""

    @property
    def model_name(self) -> str:
        """The served model's name (known before loading: its file or folder name)."""

    @property
    def max_model_len(self) -> int:
        """Prompt + output tokens a request may hold (0 until the engine has started)."""

    @property
    def tool_call_format(self) -> str | None:
        """How the model writes tool calls, from its chat template (a metrale.text.tool_parsers format),
        or None when the template shows none."""

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """The model's own sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty) for what a
        request leaves unset; {} when it ships none or the engine ignores them (generation_config "vllm")."""

    @property
    def reasoning_format(self) -> str | None:
        """How the model marks its reasoning, from its chat template (a metrale.text.reasoning format), or None."""

    async def start(self) -> Any:
        """Load the model and start serving."""

    async def drain(self, timeout_s: float) -> None:
        """Stop accepting requests; let in-flight ones finish for up to timeout_s; abort the rest."""

    async def shutdown(self) -> None:
        """Abort what is left and stop; leaves nothing running."""

    def health(self) -> EngineState:
        """"loading" | "serving" | "draining" | "unhealthy" | "stopped" (a str-valued enum)."""

    def stats(self) -> EngineStats:
        """A cheap snapshot of the engine's state."""

    def info(self) -> EngineInfo:
        """What the started engine loaded (model path, architecture, dtype, KV block size); raises
        EngineNotRunningError before start."""

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                 request_id: str | None = None, priority: int = 0, lora: str | None = None) -> RequestStream | GroupStream:
        """Queue a request (with the registered LoRA adapter `lora`, None: the base model) and return its
        stream; raises a typed rejection (metrale.errors; LoraNotFoundError for an unknown adapter)."""

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None, *,
             request_id: str | None = None, priority: int = 0, tools: Sequence[Any] | None = None,
             lora: str | None = None) -> RequestStream | GroupStream:
        """`generate` over the model's chat template rendered for `messages` (and `tools`)."""

    async def embed(self, prompts: Sequence[str | Sequence[int]], params: PoolingParams | None = None, *,
                    request_id: str | None = None, priority: int = 0) -> list[EmbeddingOutput]:
        """One embedding per prompt, in order (pooled from the final hidden states, through the scheduler);
        raises a typed rejection and queues nothing on bad input; cancelling aborts every prompt."""
    async def add_lora(self, name: str, path: str) -> None:
        """Register a LoRA adapter folder as `name`; InvalidLoraAdapterError names what does not fit."""

    def remove_lora(self, name: str) -> bool:
        """Unregister a LoRA adapter; False if unknown."""

    def list_loras(self) -> dict[str, str]:
        """Registered LoRA adapter name -> its folder."""

    async def prepare(self, params: SamplingParams) -> None:
        """Compile what `params` needs (a structured-output grammar) off the event loop, before submitting;
        raises a typed rejection (InvalidStructuredOutputError, StructuredOutputUnavailableError)."""

    async def prompt_token_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """What `generate` would submit for `prompt`; a long text is tokenized off the event loop."""

    async def chat_token_ids(self, messages: list[dict[str, Any]], tools: Sequence[Any] | None = None,
                             **template_kwargs: Any) -> list[int]:
        """What `chat` would submit for `messages` (and `tools` and `template_kwargs`, given to the chat
        template); a long conversation is tokenized off the event loop."""

    async def wait_until_dead(self) -> BaseException | None:
        """Wait for the engine loop to end: the error that killed it, or None when it was shut down."""

    def abort(self, request_id: str) -> bool:
        """End a request at the next step boundary (its stream finishes with "abort")."""

    def abort_all(self) -> None:
        """Abort every unfinished request now (a forced shutdown)."""

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of a token sequence (special tokens kept)."""

    def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        """Each token decoded alone (for logprobs); a partial UTF-8 character renders as U+FFFD."""

    def record_rejected(self, reason: str) -> None:
        """Count a request the service refused before submitting it (a REJECT_REASONS label)."""

    def metrics_exposition(self) -> bytes:
        """The engine's Prometheus metrics in the text exposition format."""

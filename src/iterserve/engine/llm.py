"""The offline API, in vLLM's style: `LLM(model=...).generate(prompts, sampling_params)`.

All prompts are queued at once and the engine steps until every one has finished, so they
are batched continuously exactly as they would be by the server; results come back in the
order of the prompts, each with text, token ids, finish reason and its latency metrics.
"""

from __future__ import annotations

from typing import Any, Sequence

from tqdm.auto import tqdm

from iterserve.core.request import PoolingParams, SamplingParams
from iterserve.engine.args import EngineArgs
from iterserve.engine.chat_tools import (parse_tool_calls, plan_offline_tools, template_messages,
                                         tool_params)
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.prompts import parse_prompts
from iterserve.errors import InvalidRequestError

PromptArg = str | list[int] | dict[str, Any]


class LLM:
    """An engine for offline batch generation.

    `LLM()` loads the bundled default model; `LLM(model=path, max_num_seqs=8, ...)` takes
    any EngineArgs field as a keyword. `LLM.from_engine(engine)` wraps a ready LLMEngine
    (tests inject a fake executor that way).
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine_args = EngineArgs(model=model, **engine_args)
        self.engine = LLMEngine.from_engine_args(self.engine_args)
        self._next_id = 0

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        self = cls.__new__(cls)
        self.engine_args = None
        self.engine = engine
        self._next_id = 0
        return self

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (vLLM's spelling): `encode`, `decode`, `apply_chat_template`."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptArg | Sequence[PromptArg],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt; one RequestOutput per prompt, in order.

        A prompt is a string, a list of token ids, `{"prompt": str}` or
        `{"prompt_token_ids": [...]}`; `prompts` is one of them or a list (engine/prompts.py).
        Bad prompts or params raise before anything runs."""
        prompt_list = parse_prompts(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"got {len(params_list)} sampling params for "
                                 f"{len(prompt_list)} prompts")
            for i, sp in enumerate(params_list):
                if not isinstance(sp, SamplingParams):
                    raise TypeError(f"sampling_params[{i}] is a {type(sp).__name__}, "
                                    "not a SamplingParams")
        prios = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(prios) != len(prompt_list):
            raise ValueError(f"got {len(prios)} priorities for {len(prompt_list)} prompts")
        # Validate and tokenise everything first, so a bad prompt leaves nothing half-queued.
        token_ids = []
        for i, (p, sp) in enumerate(zip(prompt_list, params_list)):
            self.engine.input_processor.check_params(sp)
            # compiles the grammar (cached for add_request) and checks the vocabulary fields
            self.engine.input_processor.resolve_constraints(sp)
            try:
                ids = self.engine.tokenize_prompt(p.value)
                self.engine.check_lengths(len(ids), sp.max_tokens)
            except InvalidRequestError as e:
                if len(prompt_list) > 1:
                    e.args = (f"prompt {i}: {e}",)
                raise
            token_ids.append(ids)
        rids = []
        for p, ids, sp, prio in zip(prompt_list, token_ids, params_list, prios):
            rid = f"offline-{self._next_id}"
            self._next_id += 1
            self.engine.add_request(rid, ids, sp, priority=prio, prompt_text=p.text)
            rids.append(rid)
        return self._run(rids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tool_choice: Any = None,
        tool_parser: str | None = None,
        parallel_tool_calls: bool = True,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation (a list of messages) or to several,
        then generate as `generate` does. vLLM's signature: `chat_template`,
        `add_generation_prompt`, `continue_final_message`, `tools` (OpenAI tool dicts, given
        to the template as HF's `tools=`) and `chat_template_kwargs`.

        With `tools`, each output is also parsed for calls (iterserve's addition, as the
        server's --tool-call-parser does it): `CompletionOutput.tool_calls` (tools.ToolCall:
        id, name, arguments JSON) and `.content` (the text that is not a call).
        `tool_parser` names the format (hermes, llama3_json, mistral; default hermes);
        `tool_choice` "required" or {"type": "function", "function": {"name": ...}} forces
        a call with structured outputs (arguments valid for the function's schema), "none"
        parses nothing, "auto" (the default) parses what the model writes."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        plan = None
        kw: dict[str, Any] = dict(chat_template_kwargs or {})
        if tools:
            kw["tools"], plan = plan_offline_tools(tools, tool_choice, tool_parser,
                                                   parallel_tool_calls, self.tokenizer)
        if continue_final_message:
            if add_generation_prompt:
                raise InvalidRequestError("continue_final_message needs add_generation_prompt"
                                          "=False", "continue_final_message")
            kw["continue_final_message"] = True
        prompts = [self.tokenizer.encode(
            self.tokenizer.apply_chat_template(template_messages(conv), add_generation_prompt,
                                               chat_template=chat_template, **kw),
            add_special_tokens=False) for conv in conversations]
        if plan is not None:
            sampling_params = tool_params(plan, sampling_params)
        outputs = self.generate(prompts, sampling_params, use_tqdm)
        if plan is not None:
            parse_tool_calls(plan, outputs)
        return outputs

    def embed(self, prompts: PromptArg | Sequence[PromptArg],
              pooling_params: PoolingParams | None = None, use_tqdm: bool = True
              ) -> list[RequestOutput]:
        """vLLM's LLM.embed for a model served as an embedding model (`LLM(model,
        runner="pooling")`): one RequestOutput per prompt, in order, its vector in
        `.embedding` (float32 numpy). Batched like generate; bad prompts raise first."""
        params = pooling_params or PoolingParams()
        prompt_list = parse_prompts(prompts)
        ids = []
        for i, p in enumerate(prompt_list):
            try:
                ids.append(self.engine.tokenize_prompt(p.value))
            except InvalidRequestError as e:
                if len(prompt_list) > 1:
                    e.args = (f"prompt {i}: {e}",)
                raise
        rids: list[str] = []
        try:
            for p, x in zip(prompt_list, ids):
                rid = f"offline-{self._next_id}"
                self._next_id += 1
                self.engine.add_request(rid, x, params, prompt_text=p.text)
                rids.append(rid)
        except BaseException:
            for rid in rids:
                self.engine.abort_request(rid)
            raise
        return self._run(rids, use_tqdm)

    def beam_search(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's LLM.beam_search: not implemented here (the server's use_beam_search is a
        400 too). The nearest thing iterserve has is best_of: sample best_of sequences and
        keep the n with the highest cumulative logprob."""
        raise NotImplementedError(
            "beam search is not implemented in iterserve; SamplingParams(n=N, best_of=K) "
            "samples K sequences and returns the N with the highest cumulative logprob")

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        out_tokens = 0
        try:
            while len(final) < len(ids) and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    out_tokens += sum(len(o.delta_token_ids) for o in out.outputs)
                    if out.finished and out.request_id in wanted:
                        final[out.request_id] = out
                        bar.update(1)
                        elapsed = bar.format_dict.get("elapsed") or 0
                        if elapsed:
                            bar.set_postfix_str(f"output: {out_tokens / elapsed:.1f} tok/s")
        except BaseException:
            for rid in ids:                 # Ctrl-C or a crash: free what is still queued
                if rid not in final:
                    self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [final[rid] for rid in ids]

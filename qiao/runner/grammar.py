"""Structured output: grammars that constrain sampling, through llguidance.

A request asks for one constraint in `SamplingParams.structured_outputs` (vLLM's names): `json`
(a JSON schema), `json_object` (any JSON object), `regex`, `choice` (one of some strings) or
`grammar` (Lark, or GBNF as llama.cpp writes it). `grammar_for` turns it into an llguidance
grammar and `check_structured_outputs` validates it where the request arrives (an invalid schema
or regex is a 400 naming the problem), with no tokenizer.

In the engine, `GrammarCompiler` keeps one compiled matcher per grammar (LRU) and gives each
sample a copy; in a step, the masks of every constrained row are filled together (llguidance's
parallel executor, the GIL released) into one bitmask, and `apply_token_bitmask` sets the
disallowed logits of those rows to -inf before sampling. After sampling each matcher consumes its
row's token. llguidance was chosen over xgrammar on the figures in docs/structured_output.md.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from qiao.errors import ConfigError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# Compiled grammars kept (templates each sample copies).
CACHE_SIZE = 256


def grammar_for(structured: dict[str, Any]) -> str:
    """The llguidance grammar of one `structured_outputs` constraint."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    (kind, spec), *rest = structured.items()
    assert not rest and kind in KINDS, structured
    # Compact JSON, as OpenAI's JSON mode gives: no free whitespace for the model to loop in.
    options = {"whitespace_flexible": False}
    if kind == "json":
        schema = spec if isinstance(spec, str) else json.dumps(spec)
        return LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=options)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        return LLMatcher.grammar_from_regex("|".join(re.escape(str(c)) for c in spec))
    return LLMatcher.grammar_from_lark(any_to_lark(spec))


def check_structured_outputs(structured: dict[str, Any], param: str) -> None:
    """Raise ConfigError (-> 400, naming `param`) for a constraint that cannot be compiled."""
    from llguidance import LLMatcher

    kind = next(iter(structured))
    what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar"}.get(kind, kind)
    try:
        grammar = grammar_for(structured)
    except Exception as exc:  # the parsers' own errors: JSON, GBNF
        raise ConfigError(f"{param}: invalid {what} ({exc})", param=param) from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise ConfigError(f"{param}: invalid {what}: {error}", param=param)


class GrammarCompiler:
    """Matchers for one tokenizer: compiled once per grammar, copied per sample."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        import llguidance.hf

        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None
        )
        self._templates: OrderedDict[str, Any] = OrderedDict()

    def matcher(self, structured: dict[str, Any]) -> Any:
        """A fresh matcher for one sample (ConfigError if the grammar does not compile)."""
        from llguidance import LLMatcher

        grammar = grammar_for(structured)
        template = self._templates.get(grammar)
        if template is None:
            template = LLMatcher(self._tokenizer, grammar, log_level=0)
            if template.is_error():
                raise ConfigError(
                    f"structured_outputs: {template.get_error()}", param="structured_outputs"
                )
            self._templates[grammar] = template
            if len(self._templates) > CACHE_SIZE:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(grammar)
        return template.deep_copy()


class MaskFiller:
    """Fills the token masks of a step's constrained rows together (threads, no GIL)."""

    def __init__(self, vocab_size: int) -> None:
        import llguidance

        self._executor = llguidance.LLExecutor()
        self._bitmask = torch.empty(0, (vocab_size + 31) // 32, dtype=torch.int32)

    def fill(self, matchers: list[Any]) -> torch.Tensor:
        """The bitmask rows (int32; bit t % 32 of word t // 32 set = token t allowed)."""
        rows = len(matchers)
        if self._bitmask.shape[0] < rows:
            self._bitmask = torch.empty(rows, self._bitmask.shape[1], dtype=torch.int32)
        bitmask = self._bitmask[:rows]
        self._executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)],
            bitmask.data_ptr(),
            bitmask.shape[1] * bitmask.element_size(),
            rows,
        )
        return bitmask


# What a refused token's logit drops by: far below any real logit, yet finite, so a logprob that
# reports a refused token (top-k wider than what the grammar allows) stays valid JSON. Adding it
# is branch-free: masked_fill with a grammar's scattered bits ran ~10x slower on 64 x 49k.
REFUSED_LOGIT = -1e30


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None
) -> None:
    """Push the logits of tokens a bitmask disallows down by 1e30 (to about -1e30), in place:
    bitmask row j masks logits row `rows[j]` (all rows in order when `rows` is None).

    The bits are unpacked by numpy on the host (the int32 words read as little-endian bytes,
    bit order little, give token order), inverted so a 1 means "refused"."""
    vocab = logits.shape[-1]
    words = bitmask.numpy() if bitmask.device.type == "cpu" else bitmask.cpu().numpy()
    refused = np.unpackbits(~words.view(np.uint8), axis=1, bitorder="little")
    if refused.shape[1] < vocab:  # logits wider than the tokenizer: padding ids never allowed
        refused = np.pad(refused, ((0, 0), (0, vocab - refused.shape[1])), constant_values=1)
    mask = torch.from_numpy(np.ascontiguousarray(refused[:, :vocab])).to(logits.device)
    if rows is None:
        logits.add_(mask, alpha=REFUSED_LOGIT)
    else:
        index = torch.tensor(rows, device=logits.device)
        logits.index_add_(0, index, mask.to(logits.dtype), alpha=REFUSED_LOGIT)

"""Structured outputs through xgrammar: constraints checked and compiled against the model's vocabulary
(`GrammarCompiler`, with an LRU of compiled grammars), one matcher per sequence (`SequenceGrammar`), and
the per-step allowed-token bitmask of a batch's rows (`fill_token_masks`), which the launcher applies to
the logits on the device."""

from swaserve.grammar.compiler import GrammarCompiler, check_constraint
from swaserve.grammar.matcher import MaskRows, SequenceGrammar, fill_token_masks

__all__ = ["GrammarCompiler", "MaskRows", "SequenceGrammar", "check_constraint", "fill_token_masks"]

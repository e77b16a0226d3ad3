"""Structured outputs through xgrammar: constraints checked and compiled against the model's vocabulary
(`GrammarCompiler`, with an LRU of compiled grammars), one matcher per sequence (`SequenceGrammar`), and
the per-step allowed-token bitmasks of a batch's constrained rows (`fill_token_masks`), which
the launcher applies to the logits on the device."""

from swaserve.grammar.compiler import GrammarCompiler, check_constraint
from swaserve.grammar.masks import MaskRows, TokenMasks, fill_token_masks
from swaserve.grammar.matcher import SequenceGrammar

__all__ = ["GrammarCompiler", "MaskRows", "SequenceGrammar", "TokenMasks", "check_constraint", "fill_token_masks"]

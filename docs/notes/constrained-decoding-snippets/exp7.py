from mlx_lm.utils import load_tokenizer
from pathlib import Path
import llguidance, llguidance.hf
tw = load_tokenizer(Path("/root/.cache/specdec/models/SmolLM2-135M-Instruct-f32"))
ltok = llguidance.hf.from_tokenizer(tw._tokenizer, eos_token=sorted(tw.eos_token_ids))
for src in ['start: "A" txt\ntxt[max_tokens=5]: /[a-z]+/', 'start: "A" txt\ntxt[stop="."]: /[a-z ]+/']:
    g = llguidance.grammar_from("lark", src)
    print(repr(src), "validate:", llguidance.LLMatcher.validate_grammar_with_warnings(g, ltok))
    m = llguidance.LLMatcher(ltok, g, log_level=0)
    t = ltok.tokenize_str("Aab")
    print("  consume", m.consume_tokens(t), "rollback(1) ->", m.rollback(1), "is_error", m.is_error(), "err:", m.get_error()[:100])

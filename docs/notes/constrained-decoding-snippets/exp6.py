import transformers
from mlx_lm.utils import load_tokenizer
from pathlib import Path
import llguidance, llguidance.hf
MP=Path("/root/.cache/specdec/models/SmolLM2-135M-Instruct-f32")
tw = load_tokenizer(MP)
print("PreTrainedTokenizerFast is", transformers.PreTrainedTokenizerFast, "isinstance inner:", isinstance(tw._tokenizer, transformers.PreTrainedTokenizerFast))
try:
    llguidance.hf.from_tokenizer(tw)
    print("from_tokenizer(wrapper) ok")
except Exception as e:
    print("from_tokenizer(wrapper) ->", type(e).__name__, e)
ltok = llguidance.hf.from_tokenizer(tw._tokenizer, n_vocab=49152, eos_token=sorted(tw.eos_token_ids))
g = llguidance.grammar_from("lark", 'start: "A" TXT\nTXT[max_tokens=5]: /[a-z]+/')
print("validate:", llguidance.LLMatcher.validate_grammar_with_warnings(g, ltok))
m = llguidance.LLMatcher(ltok, g, log_level=0)
t = ltok.tokenize_str("Aab")
print("consume", m.consume_tokens(t), "rollback(1) ->", m.rollback(1), "err:", m.get_error()[:110])
g = llguidance.grammar_from("lark", 'start: "A" /[a-z]+/')
m = llguidance.LLMatcher(ltok, g, log_level=0)
print("no max_tokens: consume", m.consume_tokens(t), "rollback(1) ->", m.rollback(1))
bad = llguidance.grammar_from("lark", 'start: foo')
print("bad grammar validate:", repr(llguidance.LLMatcher.validate_grammar(bad, ltok))[:120])
mb = llguidance.LLMatcher(ltok, bad, log_level=0)
print("bad grammar matcher: is_error", mb.is_error(), repr(mb.get_error()[:100]))
print("special token allowed? mask of json grammar for <|im_start|>(1):", end=" ")
import numpy as np, llguidance.numpy as lgnp
mj = llguidance.LLMatcher(ltok, llguidance.grammar_from("json_schema", '{"type":"string"}'), log_level=0)
mj.consume_token(ltok.tokenize_str('"')[0])
bm = lgnp.allocate_token_bitmask(1, ltok.vocab_size); lgnp.fill_next_token_bitmask(mj, bm, 0)
print(bool(bm[0,0]>>1 & 1), "; allowed in string:", int(np.unpackbits(bm.view(np.uint8)).sum()))
print("tokenizer special ids:", [i for i in range(20) if ltok.is_special_token(i)])

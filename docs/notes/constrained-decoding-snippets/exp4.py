import numpy as np
from mlx_lm.utils import load_tokenizer
from pathlib import Path
import llguidance, llguidance.hf, llguidance.numpy as lgnp
MP=Path("/root/.cache/specdec/models/SmolLM2-135M-Instruct-f32")
tw = load_tokenizer(MP)
ltok = llguidance.hf.from_tokenizer(tw._tokenizer, eos_token=sorted(tw.eos_token_ids))
V=ltok.vocab_size
schema={"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"}},"required":["name","age"]}
g = llguidance.LLMatcher.grammar_from_json_schema(schema)
m = llguidance.LLMatcher(ltok, g, log_level=0)
m.consume_token(ltok.tokenize_str('{"')[0])
for piece in ["n", "na", "nam", "name", "name\""]:
    ids = ltok.tokenize_str(piece)
    print(repr(piece), ids, ltok.dbg_tokens(ids), "validate:", m.validate_tokens(ids))
bm = lgnp.allocate_token_bitmask(1, V); lgnp.fill_next_token_bitmask(m, bm, 0)
al = np.nonzero(np.unpackbits(bm.view(np.uint8), bitorder="little")[:V])[0]
print("mask:", [ltok.dbg_tokens([int(a)]) for a in al])
n_id = ltok.tokenize_str("n")[0]
print("consume 'n':", m.consume_token(n_id), m.get_error()[:100])
bm = lgnp.allocate_token_bitmask(1, V); lgnp.fill_next_token_bitmask(m, bm, 0)
al = np.nonzero(np.unpackbits(bm.view(np.uint8), bitorder="little")[:V])[0]
print("after 'n' mask:", [ltok.dbg_tokens([int(a)]) for a in al][:10])
# a schema whose keys share a prefix (the doc's example)
s2 = {"properties": {"orderId": {"type":"string"}, "orderName": {"type":"string"}}, "required": [], "additionalProperties": False}
m2 = llguidance.LLMatcher(ltok, llguidance.LLMatcher.grammar_from_json_schema(s2, defaults={"whitespace_flexible": False}), log_level=0)
m2.consume_token(ltok.tokenize_str('{"')[0])
lgnp.fill_next_token_bitmask(m2, bm, 0)
al = np.nonzero(np.unpackbits(bm.view(np.uint8), bitorder="little")[:V])[0]
print("orderId/orderName after {\": mask", [ltok.dbg_tokens([int(a)]) for a in al], "ff", ltok.dbg_tokens(m2.compute_ff_tokens()), m2.compute_ff_bytes())

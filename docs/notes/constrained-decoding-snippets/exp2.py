import time, json
import numpy as np
from mlx_lm.utils import load_tokenizer
from pathlib import Path
import llguidance, llguidance.hf, llguidance.numpy as lgnp
MP=Path("/root/.cache/specdec/models/SmolLM2-135M-Instruct-f32")
tw = load_tokenizer(MP)
ltok = llguidance.hf.from_tokenizer(tw._tokenizer, eos_token=sorted(tw.eos_token_ids))
V = ltok.vocab_size
schema={"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"}},"required":["name","age"]}
g = llguidance.LLMatcher.grammar_from_json_schema(schema)
m = llguidance.LLMatcher(ltok, g, log_level=0)
def popcount(bm):
    return int(np.unpackbits(bm.view(np.uint8)).sum())
def allowed(bm):
    return np.nonzero(np.unpackbits(bm.view(np.uint8), bitorder="little")[:V])[0]
text = '{"name": "Bob Smith", "age": 42}'
toks = tw._tokenizer.encode(text, add_special_tokens=False)
print("tokens", toks, ltok.dbg_tokens(toks))
bm = lgnp.allocate_token_bitmask(1, V)
times=[]
for i,t in enumerate(toks):
    t0=time.perf_counter(); lgnp.fill_next_token_bitmask(m, bm, 0); dt=time.perf_counter()-t0; times.append(dt)
    ok_bit = bool((bm[0, t//32] >> (t%32)) & 1)
    ff = m.compute_ff_tokens()
    print(f"step {i:2d} next={ltok.dbg_tokens([t]):12s} in_mask={ok_bit} allowed={popcount(bm):6d} mask={dt*1e6:6.0f}us ff={ltok.dbg_tokens(ff)} accepting={m.is_accepting()} stopped={m.is_stopped()}")
    assert m.consume_token(t), m.get_error()
lgnp.fill_next_token_bitmask(m, bm, 0)
print("after all: allowed", popcount(bm), [ltok.dbg_tokens([int(a)]) for a in allowed(bm)[:5]], "accepting", m.is_accepting(), "stopped", m.is_stopped(), m.stop_reason())
print("mask times us: median %.0f max %.0f mean %.0f" % (np.median(times)*1e6, max(times)*1e6, np.mean(times)*1e6))
# EOS
print("validate [eos]:", m.validate_tokens([2]))
print("consume eos:", m.consume_token(2), "stopped", m.is_stopped(), m.stop_reason(), "err", m.get_error())
print("consume eos again:", m.consume_token(2))
print("rollback 1:", m.rollback(1), "stopped", m.is_stopped(), "err", repr(m.get_error()))
lgnp.fill_next_token_bitmask(m, bm, 0); print("  allowed after rb1", popcount(bm))
print("rollback 1 more:", m.rollback(1), "stopped", m.is_stopped())
lgnp.fill_next_token_bitmask(m, bm, 0); print("  allowed after rb2", popcount(bm), [ltok.dbg_tokens([int(a)]) for a in allowed(bm)[:5]])
# reset and validate_tokens
m.reset()
bad = toks[:5] + [ltok.tokenize_str("x")[0]] + toks[6:]
print("validate_tokens(full)", m.validate_tokens(toks), "of", len(toks))
print("validate_tokens(bad@5)", m.validate_tokens(bad))
print("validate_tokens(full+eos)", m.validate_tokens(toks+[2]), "(full+eos+x)", m.validate_tokens(toks+[2, 100]))
t0=time.perf_counter(); n = m.validate_tokens(toks[:8]); print("validate 8 tok %.0fus"%((time.perf_counter()-t0)*1e6), n)
print("try_consume_tokens(bad)", m.try_consume_tokens(bad), "err", repr(m.get_error()))
print("rollback(5)", m.rollback(5), "now try_consume rest", m.try_consume_tokens(toks[5:]))
print("rollback(100) beyond history:", m.rollback(100), "err:", m.get_error()[:120])
m = llguidance.LLMatcher(ltok, g, log_level=0)
print("consume invalid token:", m.consume_token(ltok.tokenize_str("x")[0]), "is_error", m.is_error(), repr(m.get_error()[:150]))
print("rollback after error:", m.rollback(1), "still error", m.is_error())
lgnp.fill_next_token_bitmask(m, bm, 0); print("mask in error state allowed:", popcount(bm), allowed(bm))
# deep copy cost
m = llguidance.LLMatcher(ltok, g, log_level=0); m.consume_tokens(toks[:6])
t0=time.perf_counter()
for _ in range(100): c = m.deep_copy()
print("deep_copy %.1fus" % ((time.perf_counter()-t0)/100*1e6))
t0=time.perf_counter()
for _ in range(100):
    m.consume_tokens(toks[6:9]); m.rollback(3)
print("consume 3 + rollback 3: %.1fus" % ((time.perf_counter()-t0)/100*1e6))
# mask for k+1 rows manually vs executor draft helper
ex = llguidance.LLExecutor(num_threads=1)
block = toks[6:12]
bmk = lgnp.allocate_token_bitmask(len(block)+1, V)
for rep in range(2):
    t0=time.perf_counter()
    lgnp.fill_next_token_bitmask_par_with_draft_tokens(ex, [(m, 0, block)], bmk)
    dt_ex=time.perf_counter()-t0
man = lgnp.allocate_token_bitmask(len(block)+1, V)
t0=time.perf_counter()
for i in range(len(block)+1):
    lgnp.fill_next_token_bitmask(m, man, i)
    if i < len(block): assert m.consume_token(block[i])
m.rollback(len(block))
dt_man=time.perf_counter()-t0
print(f"k+1={len(block)+1} rows: executor-with-draft {dt_ex*1e6:.0f}us, manual loop {dt_man*1e6:.0f}us, equal={np.array_equal(bmk, man)}")
bad_block = block[:2] + [ltok.tokenize_str("x")[0]] + block[3:]
bmk2 = np.zeros((len(bad_block)+1, bmk.shape[1]), dtype=np.int32)
lgnp.fill_next_token_bitmask_par_with_draft_tokens(ex, [(m, 0, bad_block)], bmk2)
print("rows written for a block forbidden at 2:", [popcount(bmk2[i:i+1]) for i in range(len(bad_block)+1)], "(0 = untouched)")
lgnp.fill_next_token_bitmask(m, bm, 0); print("matcher restored:", np.array_equal(bm[0], bmk[0]))

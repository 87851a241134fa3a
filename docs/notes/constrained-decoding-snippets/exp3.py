import time
import numpy as np
from mlx_lm.utils import load_tokenizer
from pathlib import Path
import llguidance, llguidance.hf, llguidance.numpy as lgnp
MP=Path("/root/.cache/specdec/models/SmolLM2-135M-Instruct-f32")
tw = load_tokenizer(MP)
ltok = llguidance.hf.from_tokenizer(tw._tokenizer, eos_token=sorted(tw.eos_token_ids))
V = ltok.vocab_size
def pc(bm): return int(np.unpackbits(bm.view(np.uint8)).sum())
def allowed(bm): return np.nonzero(np.unpackbits(bm.reshape(-1).view(np.uint8), bitorder="little")[:V])[0]
bm = lgnp.allocate_token_bitmask(1, V)
schema={"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"}},"required":["name","age"]}
g = llguidance.LLMatcher.grammar_from_json_schema(schema)
m = llguidance.LLMatcher(ltok, g, log_level=0)
toks = tw._tokenizer.encode('{"name": "Bob", "age": 42}', add_special_tokens=False)
X = ltok.tokenize_str("x")[0]
bad = toks[:2] + [X] + toks[3:]
print("validate_tokens(bad@2)", m.validate_tokens(bad), "is_error", m.is_error())
m.consume_tokens(toks[:4])
print("rollback(10) > history ->", m.rollback(10), "is_error", m.is_error())
# regex: accepting but not stopped
for kind, src in [("regex", r"[0-9]{1,4}"), ("lark", 'start: "yes" | "no" | NUM\nNUM: /[0-9]+/')]:
    gg = llguidance.grammar_from(kind, src)
    mm = llguidance.LLMatcher(ltok, gg, log_level=0)
    print(kind, "err", repr(mm.get_error()))
    t = ltok.tokenize_str("4")[0]
    mm.consume_token(t)
    lgnp.fill_next_token_bitmask(mm, bm, 0)
    print(f"  after '4': allowed={pc(bm)} eos_allowed={bool(bm[0,0]>>2 &1)} accepting={mm.is_accepting()} stopped={mm.is_stopped()}")
    print("  validate [eos] ->", mm.validate_tokens([2]))
    print("  consume eos ->", mm.consume_token(2), "stopped", mm.is_stopped(), mm.stop_reason())
    print("  rollback(1) ->", mm.rollback(1), "stopped", mm.is_stopped())
    lgnp.fill_next_token_bitmask(mm, bm, 0)
    print("  after rollback(1): allowed", pc(bm), "(1 ⇒ EOS was tracked and undone; 10+ ⇒ the '4' was undone)")
# regex ff
gg = llguidance.grammar_from("regex", r"Answer: (yes|no)\.")
mm = llguidance.LLMatcher(ltok, gg, log_level=0)
print("regex ff:", ltok.dbg_tokens(mm.compute_ff_tokens()), mm.compute_ff_bytes())
# ff tokens vs singleton masks along a compact JSON
g2 = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
m2 = llguidance.LLMatcher(ltok, g2, log_level=0)
text = '{"name":"Bob","age":42}'
seq = tw._tokenizer.encode(text, add_special_tokens=False)
print("compact seq", ltok.dbg_tokens(seq))
pos=0
while pos < len(seq):
    ff = m2.compute_ff_tokens()
    lgnp.fill_next_token_bitmask(m2, bm, 0)
    print(f"  pos {pos}: mask={pc(bm)} ff={ltok.dbg_tokens(ff)} next={ltok.dbg_tokens([seq[pos]])}")
    if ff and seq[pos:pos+len(ff)] == ff:
        # check masks along the ff run
        pcs=[]
        for f in ff:
            lgnp.fill_next_token_bitmask(m2, bm, 0); pcs.append(pc(bm)); m2.consume_token(f)
        print("     ff run masks", pcs)
        pos += len(ff)
    else:
        m2.consume_token(seq[pos]); pos += 1
# timing: full mask per step on a longer generation (string content => big masks)
m3 = llguidance.LLMatcher(ltok, g, log_level=0)
long = tw._tokenizer.encode('{"name": "' + "the quick brown fox jumps over the lazy dog " * 5 + '", "age": 123456}', add_special_tokens=False)
ts=[]
for t in long:
    t0=time.perf_counter(); lgnp.fill_next_token_bitmask(m3, bm, 0); ts.append(time.perf_counter()-t0); assert m3.consume_token(t)
ts=np.array(ts)*1e6
print(f"mask us over {len(long)} steps: median {np.median(ts):.0f} p90 {np.percentile(ts,90):.0f} max {ts.max():.0f}")
# a fresh matcher per request: cost
t0=time.perf_counter()
for _ in range(20): llguidance.LLMatcher(ltok, g, log_level=0)
print("LLMatcher(): %.2fms" % ((time.perf_counter()-t0)/20*1e3))
t0=time.perf_counter()
for _ in range(20): llguidance.LLMatcher.grammar_from_json_schema(schema)
print("grammar_from_json_schema: %.0fus" % ((time.perf_counter()-t0)/20*1e6))

import sys, torch
sys.path.insert(0, "tests/gpu"); sys.path.insert(0, ".")
x = torch.tensor([1000.0, -1e4, 448.0, 460.0, 0.3], device="cuda")
print("torch cuda cast f32:", x.to(torch.float8_e4m3fn).float().tolist())
print("torch cuda cast bf16:", x.bfloat16().to(torch.float8_e4m3fn).float().tolist())
import test_rope_kv as T
from engine.kernels import rope_kv
for (h, hkv), d, t, dt in [((32, 8), 64, 1, torch.bfloat16), ((8, 2), 64, 1, torch.bfloat16), ((32, 8), 128, 7, torch.bfloat16)]:
    gen = torch.Generator(device="cuda").manual_seed(t * 1000 + d + h)
    cs = T._cos_sin_cache(d)
    qkv, pos, cache, rows = T._inputs(t, h, hkv, d, dt, gen, torch.float8_e4m3fn)
    before = (qkv.clone(), cache.clone())
    rq, rc = qkv.clone(), cache.clone()
    T._reference(rq, pos, cs, rc, rows, h, hkv, d)
    rope_kv.rope_and_write_kv(qkv, pos, cs, cache, rows, h, hkv, d)
    torch.cuda.synchronize()
    f, r = cache.view(-1, hkv, d)[rows[0]], rc.view(-1, hkv, d)[rows[0]]
    fv, rv = cache.view(-1, hkv, d)[rows[1]], rc.view(-1, hkv, d)[rows[1]]
    print(h, hkv, d, t, "nan kernel k", f.float().isnan().sum().item(), "nan ref k", r.float().isnan().sum().item(),
          "nan kernel v", fv.float().isnan().sum().item(), "nan ref v", rv.float().isnan().sum().item(),
          "k bytes differ", (f.view(torch.uint8) != r.view(torch.uint8)).sum().item(), "of", f.numel(),
          "v bytes differ", (fv.view(torch.uint8) != rv.view(torch.uint8)).sum().item())
    kin = qkv[:, h * d:(h + hkv) * d].view(t, hkv, d)
    bad = (f.view(torch.uint8) != r.view(torch.uint8))
    idx = bad.nonzero()[:6]
    for i in idx.tolist():
        print("  at", i, "kernel", f[tuple(i)].float().item(), hex(f[tuple(i)].view(torch.uint8).item()),
              "ref", r[tuple(i)].float().item(), hex(r[tuple(i)].view(torch.uint8).item()),
              "roped k (bf16 in qkv)", kin[tuple(i)].float().item(), "ref roped k", rq[:, h*d:(h+hkv)*d].view(t,hkv,d)[tuple(i)].float().item())

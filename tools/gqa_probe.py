# Probe: cuDNN SDPA backward cost for grouped-query shapes vs MHA vs query packing (torch).
import glob, os, torch, torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version(), torch.cuda.get_device_name())
print([p for p in glob.glob("/usr/**/libcudnn.so*", recursive=True)][:10])
print([p for p in glob.glob(os.path.dirname(torch.__file__)+"/../nvidia/cudnn/lib/*")][:10])
dev="cuda"; bf=torch.bfloat16
def timeit(fn, n=10):
    fn(); torch.cuda.synchronize()
    s=torch.cuda.Event(enable_timing=True); e=torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n): fn()
    e.record(); torch.cuda.synchronize(); return s.elapsed_time(e)/n
def case(name, B, hq, hk, Lq, Lk, D, backend, gqa=False, causal=False):
    q=torch.randn(B,hq,Lq,D,device=dev,dtype=bf,requires_grad=True)
    k=torch.randn(B,hk,Lk,D,device=dev,dtype=bf,requires_grad=True)
    v=torch.randn(B,hk,Lk,D,device=dev,dtype=bf,requires_grad=True)
    try:
        with sdpa_kernel(backend):
            o=F.scaled_dot_product_attention(q,k,v,enable_gqa=gqa,is_causal=causal)
            g=torch.randn_like(o)
            tf=timeit(lambda: F.scaled_dot_product_attention(q,k,v,enable_gqa=gqa,is_causal=causal))
            def fb():
                o=F.scaled_dot_product_attention(q,k,v,enable_gqa=gqa,is_causal=causal)
                torch.autograd.grad(o,(q,k,v),g)
            tfb=timeit(fb)
        print(f"{name:40s} fwd {tf:7.3f} ms  fwd+bwd {tfb:7.3f} ms  bwd {tfb-tf:7.3f}")
    except Exception as ex:
        print(f"{name:40s} failed: {str(ex)[:200]}")
for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
  for (B,L,hq) in ((128,2048,6),(32,8192,5)):
    b=str(backend).split('.')[-1]
    case(f"{b} MHA B{B} L{L} h{hq}", B,hq,hq,L,L,128,backend)
    case(f"{b} GQA1 B{B} L{L} h{hq}", B,hq,1,L,L,128,backend,gqa=True)
    case(f"{b} packed B{B} L{L} 1x{hq}L", B,1,1,L*hq,L,128,backend)
  case(f"{b} MHA B128 L2048 h4", 128,4,4,2048,2048,128,backend)
  case(f"{b} GQA B128 L2048 h4/1", 128,4,1,2048,2048,128,backend,gqa=True)
  case(f"{b} MHA B128 L2048 h16", 128,16,16,2048,2048,128,backend)
  case(f"{b} GQA B128 L2048 h16/4", 128,16,4,2048,2048,128,backend,gqa=True)

"""Two recurrent fprops of the sparse-wide LSTM (N 8 and 32, bf16, 10 %) for Nsight Compute: which bound."""
import cupy, bsmm
from bsmm.nn.lstm_gates import gate_layout
from bsmm.layouts.small_world import small_world_layout
b=384
op=bsmm.BlocksparseMatMul(gate_layout(small_world_layout(b, round(0.1*b*b),"barabasi_albert",0),b),block_size=32)
w=cupy.random.standard_normal(op.w_shape,dtype=cupy.float32).astype("bfloat16")
for n in (8,32):
    x=cupy.random.standard_normal((n,op.C),dtype=cupy.float32).astype("bfloat16"); y=cupy.empty((n,op.K),"bfloat16")
    for _ in range(3): op.fprop(x,w,out=y)
cupy.cuda.Device().synchronize()

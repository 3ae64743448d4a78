import sys, os, traceback, torch
sys.path.insert(0, os.getcwd())
from autopipe.measure import RunSetup, segment_starts, time_stages
from autopipe.models import default_input, load_model
from autopipe.partition.partitioner import partition_at
from autopipe.tracer import trace
from autopipe.stages.emit import emit_stages
import autopipe.measure.timer as T
name = sys.argv[1]
model = load_model(f"timm:{name}")
traced = trace(model, (default_input(model, 32),))
starts = segment_starts(traced, 10**6, "h100")
plan = partition_at(traced, starts, device="h100", activation_dtype=torch.bfloat16)
setup = RunSetup(torch.device("cuda"), "graphs", torch.bfloat16, reps=3)
stages = emit_stages(traced, plan)
inputs = T._model_inputs(traced, setup.device)
bad = 0
for i in range(plan.num_stages):
    st = T._prepare(stages[i], setup, last=i == plan.num_stages - 1)
    grads = [i > 0 and x.is_floating_point() for x in inputs]
    try:
        _, outs = T._time(st, inputs, grads, setup)
    except Exception as e:
        bad += 1
        if bad <= 3:
            print("SEGMENT", i, plan.stages[i].nodes, [ (tuple(x.shape), x.dtype) for x in inputs])
            print(st.code)
            traceback.print_exc(limit=3)
        torch.cuda.synchronize()
        st2 = T._prepare(stages[i], RunSetup(setup.device, "eager", torch.bfloat16), last=False)
        with torch.no_grad():
            outs = st2(*inputs)
    inputs = tuple(o.detach() for o in outs)
print("bad", bad, "of", plan.num_stages)

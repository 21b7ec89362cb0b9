"""Stages 1-2 with overlap_param_gather: the module hooks that wait for each bucket's
parameter all-gather (C++ Note [overlapped parameter gather], runtime/param_gathers.h).

An applied step() returns with every bucket's gather in flight. Before a module that holds
parameters of its own runs forward, or gives its state_dict(), the gathers of the buckets
holding them are waited for: the first layers wait for their own buckets while the later
layers' gathers go on. The engine waits for the rest at the end of its forward and before
its state methods read the weights; the C++ Engine before anything of its own writes them.
"""
import weakref

from zerort.engine.alive import alive


class ParamWaits:
    def __init__(self, engine, model, param_index):
        self.pending = False  # gathers may be in flight: set before each step() that may update, cleared by wait_all
        self.handles = []  # removed by engine.destroy()
        impl = engine.runtime
        bucket = {id(p): impl.bucket_of(g, i) for g, group in enumerate(param_index.groups)
                  for i, p in enumerate(group)}
        ref = weakref.ref(engine)  # the model's hooks must not keep the engine alive
        for m in model.modules():
            mine = sorted({bucket[id(p)] for p in m.parameters(recurse=False) if id(p) in bucket})
            if mine:
                self.handles.append(m.register_forward_pre_hook(self._waiter(ref, mine)))
                self.handles.append(m.register_state_dict_pre_hook(self._waiter(ref, mine)))

    def _waiter(self, ref, buckets):
        def hook(module, *args):
            if self.pending:
                impl = alive(ref).runtime
                for b in buckets:
                    impl.wait_param_gather(b)
        return hook

    @staticmethod
    def wanted(engine):
        """The hooks are needed: overlap_param_gather's gathers, or stages 1-2's overlapped step,
        whose hooks wait for each bucket's update before its gather (C++ Note [overlapped step])."""
        impl = engine.runtime
        return impl.overlaps_param_gather or (engine._overlaps_step and engine.config.stage < 3)

    @staticmethod
    def overlapped_step(engine, boundary, step):
        """step(), the C++ step, with the overlapped update's Python side (C++ Note [overlapped
        step]): stage 3's next forward's unit order handed over first; the result's update_wait_ms,
        what the last update kept the compute waiting (the device's idle time): the forward's waits
        for its units, and the caller's other waits (stage 3's step() for the units it gathers itself,
        W = 1's prefetch; C++ Waiter); the
        update finished before the monitor's all-gather, which no gather of the worker's may cross."""
        impl = engine.runtime
        if not (boundary and engine._overlaps_step):
            return step()
        report = impl.overlap_report
        waited_ms = 1e3 * (report["waited_seconds"] + report["caller_waited_seconds"])
        if engine._units:
            impl.set_update_order(engine._units.next_order())
        s = step()
        s["update_wait_ms"] = waited_ms
        if engine._monitor:
            impl.finish_update()
        return s

    def wait_all(self, impl):
        """Every bucket's gather done: the working copies are whole."""
        if self.pending:
            impl.wait_param_gathers()
            self.pending = False

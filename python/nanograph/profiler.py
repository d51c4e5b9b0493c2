"""vLLM's profiler_config: a trace of the engine's steps between start_profile() and stop_profile().

profiler="torch" records torch.profiler's trace of the engine's process (its host code, and on a GPU every kernel the
core and torch launch, graph replays included) into torch_profiler_dir, one file per profile, named
"rank0.<time>.pt.trace.json[.gz]" (open it in Perfetto or chrome://tracing); with torch_profiler_dump_cuda_time_total,
the profile's table of ops by self time is written beside it as "profiler_out_0.txt". Each engine step is a
"nanograph.step" range in the trace, and its forward a "nanograph.forward" range named by the batch's kind and size.
profiler="cuda" brackets the profile with cudaProfilerStart/Stop, for Nsight Systems'
`--capture-range=cudaProfilerApi`, the same ranges as NVTX ranges.

delay_iterations: engine steps skipped after start_profile() before recording begins; max_iterations: steps recorded
before the profile ends by itself (0: until stop_profile()). A tensor-parallel engine records rank 0's process (the
scheduler, the sampler and rank 0's shard), not its worker processes."""
from __future__ import annotations

import contextlib
import logging
import os

import torch

from .config import ProfilerConfig

TRACE_WORKER_NAME = "rank0"
CUDA_TIME_TABLE = "profiler_out_0.txt"

logger = logging.getLogger("nanograph")


class EngineProfiler:
    """The engine's profiler: start() and stop() from the API, step() around each engine step. Not thread-safe: the
    engine calls it under its lock. As vLLM's: a start while a profile runs, or a stop while none does, changes
    nothing (a warning says so); a profiler that fails between steps (its folder, its trace) ends its profile with an
    error logged, and the engine goes on."""

    def __init__(self, config: ProfilerConfig, device: torch.device):
        if config.profiler == "cuda" and device.type != "cuda":
            raise ValueError(f"profiler_config.profiler='cuda' brackets a profile for Nsight Systems, and this engine "
                             f"runs on {device.type}; use profiler='torch' (with a torch_profiler_dir)")
        self.config = config
        self.device = device
        self.running = False  # between start() and stop(), or the end max_iterations sets
        self._steps = 0  # engine steps since start()
        self._torch: torch.profiler.profile | None = None
        self.recording = False  # a profile is being recorded (running, and past delay_iterations)
        self._worker_name = TRACE_WORKER_NAME

    def start(self, profile_prefix: str | None = None):
        """profile_prefix: the trace file's name starts with it (vLLM's), then "_rank0"."""
        if self.running:
            logger.warning("start_profile(): the profiler is already running; nothing changed")
            return
        if profile_prefix is not None and (not isinstance(profile_prefix, str) or not profile_prefix
                                           or os.sep in profile_prefix):
            raise ValueError(f"profile_prefix must be a non-empty file name prefix (no {os.sep!r}), got "
                             f"{profile_prefix!r}")
        if self.config.profiler == "torch":
            try:
                os.makedirs(self.config.torch_profiler_dir, exist_ok=True)
            except OSError as exc:
                raise ValueError(f"profiler_config.torch_profiler_dir={self.config.torch_profiler_dir!r} cannot be "
                                 f"made a folder ({exc}); give a folder this process can write") from None
        self._worker_name = f"{profile_prefix}_{TRACE_WORKER_NAME}" if profile_prefix else TRACE_WORKER_NAME
        self._steps = 0
        if self.config.delay_iterations == 0:
            self._begin()
        self.running = True

    def stop(self):
        """End the profile (writing its trace), if it has not ended by itself (max_iterations)."""
        if not self.running:
            logger.warning("stop_profile(): the profiler is not running; nothing changed")
            return
        self.running = False
        self._end()

    @contextlib.contextmanager
    def step(self):
        """One engine step: a "nanograph.step" range of the trace while recording; it counts towards
        delay_iterations and max_iterations."""
        with self.range("nanograph.step"):
            yield
        if not self.running:
            return
        self._steps += 1
        config = self.config
        try:
            if not self.recording and self._steps == config.delay_iterations:
                self._begin()
            elif self.recording and config.max_iterations and \
                    self._steps == config.delay_iterations + config.max_iterations:
                self.running = False
                self._end()
        except Exception:  # the profile's, not the step's: the step's outputs stand
            self.running, self.recording, self._torch = False, False, None
            logger.exception("the profiler failed between engine steps; its profile has ended")

    def range(self, name: str):
        """A named range while recording (torch.profiler's; NVTX's for Nsight Systems); nothing otherwise."""
        if not self.recording:
            return contextlib.nullcontext()
        if self.config.profiler == "cuda":
            return torch.cuda.nvtx.range(name)
        return torch.profiler.record_function(name)

    def _begin(self):
        if self.config.profiler == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.profiler.start()
            self.recording = True
            return
        config = self.config
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profile = torch.profiler.profile(
            activities=activities, record_shapes=config.torch_profiler_record_shapes,
            profile_memory=config.torch_profiler_with_memory, with_stack=config.torch_profiler_with_stack,
            with_flops=config.torch_profiler_with_flops,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(config.torch_profiler_dir,
                                                                    worker_name=self._worker_name,
                                                                    use_gzip=config.torch_profiler_use_gzip))
        profile.start()
        self._torch, self.recording = profile, True

    def _end(self):
        if not self.recording:
            return
        self.recording = False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the steps' kernels belong to this profile
        if self.config.profiler == "cuda":
            torch.cuda.profiler.stop()
            return
        profile, self._torch = self._torch, None
        profile.stop()  # writes the trace (on_trace_ready)
        if self.config.torch_profiler_dump_cuda_time_total:
            sort_by = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
            try:
                table = profile.key_averages().table(sort_by=sort_by, row_limit=100)
            except UnicodeDecodeError as exc:  # torch's reading of a Python stack's event names, now and then
                logger.warning("the profile's trace is written, but not its table of ops: torch could not read its "
                               "events (%s); torch_profiler_with_stack=False avoids it", exc)
                return
            with open(os.path.join(self.config.torch_profiler_dir, CUDA_TIME_TABLE), "w") as out:
                out.write(table)

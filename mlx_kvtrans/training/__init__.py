"""What a fit runs: planning, stage 1 (closed form), stage 2 (distillation), the gate's
calibration, fit-time projection and sums across processes."""

source benchmarks/device_env.sh
(which ncu nsys nvdisasm cuobjdump; ls /usr/local/cuda*/bin) > $OUT/tools.txt 2>&1
for f in $(python3 -c "import jax_plugins.xla_cuda12 as p, os; print(os.path.dirname(p.__file__))" 2>/dev/null) $(python3 -c "import jaxlib, os; print(os.path.dirname(jaxlib.__file__))"); do grep -rlaE "MOSAIC_GPU_DUMP" $f 2>/dev/null | head -3 | while read so; do echo "$so"; strings -a "$so" | grep -oE "MOSAIC_GPU_[A-Z_]+" | sort -u; done; done >> $OUT/tools.txt
timeout 170 python3 -m pytest -q -x tests/test_expert_kernels.py -k "mosaic or fits" 2>&1 | tail -8 | tee $OUT/gpu_tests_kernel.txt
timeout 360 python3 -m benchmarks.int4_experts --out $OUT 2>&1 | grep -v "^W0" > $OUT/int4_experts_log.txt
grep -E "us/layer, kernels|failed" $OUT/int4_experts_log.txt | cut -c1-260
grep -A14 "^| shape | variant" $OUT/int4_experts.md | cut -c1-250

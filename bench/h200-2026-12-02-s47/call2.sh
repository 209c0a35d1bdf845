#!/bin/bash
# Session 47 call 2: ncu (L2 flushed before each profiled launch: ncu's default cache control) of the
# served NVFP4 TP4 qkv n3584 and TP1 gate_up n34816 kernels at M = 1 / 8 / 16, and the FP8 n3584 ones:
# where do the M = 16 microseconds go -- DRAM, L2 -> SM traffic (activations re-read per CTA), L1, issue?
export DFLASHGEN_CACHE=/root/dfg-cache; mkdir -p $DFLASHGEN_CACHE
[ -f $DFLASHGEN_CACHE/.unpacked ] || { cp .build/build.tar.gz $DFLASHGEN_CACHE/ && touch $DFLASHGEN_CACHE/.unpacked; }
[ -d $DFLASHGEN_CACHE/include/cute ] || cp -r .build/include $DFLASHGEN_CACHE/
source tools/gpu_env.sh; dfg_install
L=/tmp/c2; mkdir -p $OUT/c2 $L
t0=$SECONDS
MET=gpu__time_duration.sum,dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld_lookup_hit.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,launch__grid_size,smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio,smsp__average_warp_latency_issue_stalled_lg_throttle.ratio
for km in dfg_sm90_nvfp4_store_n3584_k5120_sk1_wk8_kg64_r8_nt1_wn2_st3_xa1_xs0_mb2@1 \
          dfg_sm90_nvfp4_store_n3584_k5120_sk1_wk8_kg64_r8_nt1_wn2_st3_xa1_xs0_mb2@8 \
          dfg_sm90_nvfp4_store_n3584_k5120_sk1_wk8_kg64_r8_nt1_wn2_st3_xa1_xs0_mb2@16 \
          dfg_sm90_nvfp4_store_n3584_k5120_sk1_wk8_kg64_r16_nt1_wn2_st3_xa1_xs0_mb1@16 \
          dfg_sm90_fp8_store_n3584_k5120_sk1_wk8_kg32_r8_nt1_wn2_st3_xa1_xs0_mb2@8 \
          dfg_sm90_fp8_store_n3584_k5120_sk1_wk8_kg32_r16_nt1_wn2_st3_xa1_xs0_mb2@16 \
          dfg_sm90_nvfp4_store_n34816_k5120_sk1_wk2_kg64_r8_nt2_wn2_st4_xa1_xs0_mb1@8 \
          dfg_sm90_nvfp4_store_n34816_k5120_sk1_wk2_kg64_r16_nt2_wn2_st2_xa1_xs0_mb1@16; do
  name=${km%@*} m=${km#*@}
  dflashgen build --arch 90 -j 16 -q --only "^$name\$" > /dev/null 2>&1
  timeout 120 ncu --clock-control none --metrics $MET -k "regex:$name" --launch-skip 2 --launch-count 1 \
    python3 tools/ncu_kernel.py "^$name\$" "$m" > $L/ncu-$name-m$m.txt 2>&1
  echo "== $name M=$m"; grep -E "gpu__time|dram__bytes|lts__t_sectors|l1tex__t_sectors|throughput|inst_executed|issue_active|warps_active|registers|grid_size|stalled" $L/ncu-$name-m$m.txt | sed 's/  */ /g'
done
echo "at $((SECONDS - t0)) s"
tar czf $OUT/c2/logs.tgz -C $L .

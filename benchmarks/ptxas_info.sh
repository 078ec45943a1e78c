# Registers and spills of versions of int2_decode.cu (sm_90a, Qwen3-8B geometry) on the GPU machine (nvcc):
#   MB=3 bash benchmarks/ptxas_info.sh R file.cu...      (R: position-aware pairs, 0 = constant centering;
#                                                         MB: CTAs per SM the launch bounds ask for)
R=$1; shift
MB=${MB:-3}
for f in "$@"; do
  { printf '#define D 128\n#define P 16\n#define GQA 4\n#define SINK_PAGES 4\n#define NWARPS 4\n#define MAX_PAGES 2048\n'
    printf '#define MIN_BLOCKS %s\n#define Q_KIND 1\n#define O_KIND 1\n#define STAMPS 0\n#define ROPE_R %s\n' "$MB" "$R"
    cat "$f"; } > /tmp/ptxas_k.cu
  echo "== $(basename "$f") R=$R MB=$MB: $(nvcc -arch=sm_90a -cubin -o /tmp/ptxas_k.cubin -Xptxas -v /tmp/ptxas_k.cu 2>&1 |
    grep -o 'Used [0-9]* registers\|[0-9]* bytes spill stores\|[0-9]* bytes spill loads' | tr '\n' ' ')"
done

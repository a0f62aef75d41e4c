/**
 * The tensor-core int8 matmul (kernels/matmul-int8.ts) on a GPU that has i8 subgroup matrices:
 * 1. the randomized comparisons of kernels/matmul-int8.test.ts (CI's adapters cannot run them), every case, and
 * 2. its speed at the prefill shapes of the bench's models against the f32 tiled kernels (prepareMatmul's default
 *    variant), the quantization of the activations included: µs per matmul and TFLOPS (2·N·K·T / time).
 *
 *   node bench/int8-matmul.ts [--out results.json] [--tokens 128,512] [--types Q4_K,Q4_0,Q6_K] [--skip-check]
 *                             [--skip-timing] [--ablate] [--schedules]
 *
 * Timing: bench/gpu-timing.ts (the dispatches recorded n and 5n times into one pass: per-run time without the
 * submit's round trip). Exit code 1 when a check fails.
 */
import { writeFileSync } from 'node:fs';
import { GGML_TYPE_INFO, GgmlType } from '../core/gguf-types.ts';
import { acquireGpu } from '../core/gpu/device.ts';
import { releaseDispatches, submitDispatches } from '../core/gpu/dispatch.ts';
import { nodeGpu, releaseNodeGpu } from '../core/gpu/node.ts';
import { defaultMatmulVariant, prepareMatmul } from '../kernels/matmul.ts';
import {
  createInt8Activations,
  defaultInt8Variant,
  prepareInt8Matmul,
  prepareQuantizeActivations,
  releaseInt8Activations,
} from '../kernels/matmul-int8.ts';
import {
  type Dot4Schedule,
  INT8_MATMUL_TILES,
  type Int8MatmulVariant,
  int8DotMatmulWgsl,
  int8MatmulSupportsType,
} from '../kernels/matmul-int8.wgsl.ts';
import { randomWeightBytes } from '../kernels/reference/dequantize.ts';
import { releaseWeight, uploadWeightFromBytes } from '../kernels/weights.ts';
import {
  INT8_MATMUL_TYPES,
  INT8_MATMUL_VARIANTS,
  int8MatmulCasesFor,
  runInt8MatmulCase,
} from '../test/int8-matmul-case.ts';
import { randomFloats, seededRandom } from '../test/random.ts';
import { mutateShaders } from '../test/shader-mutation.ts';
import { timeDispatches } from './gpu-timing.ts';

/** [model, matrix, K, N]: the prefill matmuls of the bench's models. */
const SHAPES: [string, string, number, number][] = [
  ['Qwen2.5-0.5B', 'q/o', 896, 896],
  ['Qwen2.5-0.5B', 'gate/up', 896, 4864],
  ['Qwen2.5-0.5B', 'down', 4864, 896],
  ['Llama-3.2-1B', 'q/o', 2048, 2048],
  ['Llama-3.2-1B', 'k/v', 2048, 512],
  ['Llama-3.2-1B', 'gate/up', 2048, 8192],
  ['Llama-3.2-1B', 'down', 8192, 2048],
  ['Qwen3-4B', 'q', 2560, 4096],
  ['Qwen3-4B', 'gate/up', 2560, 9728],
  ['Qwen3-4B', 'down', 9728, 2560],
];

function arg(name: string): string | undefined {
  const i = process.argv.indexOf(name);
  return i >= 0 ? process.argv[i + 1] : undefined;
}

/** An integer sum made a float by adding the bits of 1.5·2^23, valid for |sum| < 2^22, instead of a conversion. */
const MAGIC_CONVERT = '(bitcast<f32>($1 + 0x4B400000i) - 12582912.0)';

/**
 * Where the tensor-core kernels' time goes, at Llama-3.2-1B's gate/up shape over 512 tokens: the kernel with one
 * phase cut down (outputs are wrong; timing only).
 */
const ABLATIONS: [string, (code: string) => string][] = [
  ['full', (code) => code],
  [
    'no-apply (one output row per tile)',
    (code) =>
      code.replace(/for \(var r = 0u; r < 8u; r\+\+\) \{(\s+)let a =/g, 'for (var r = 0u; r < 1u; r++) {$1let a ='),
  ],
  // The sums made floats by adding the bits of 1.5·2^23 (|C| <= 32·127·127 < 2^22) instead of a conversion.
  ['magic-convert', (code) => code.replace(/f32\((sums\[[^\]]*\])\)/, MAGIC_CONVERT)],
  [
    'no-weight-decode (constant codes)',
    (code) =>
      code
        .replace('wnext[u] = code_word(base, b, word);', 'wnext[u] = base + b + w[0];')
        .replace('sahead[u] = code_scale(base, b + word);', 'sahead[u] = vec2<f32>(f32(base), 0.0);'),
  ],
];

/**
 * The same for the dot4I8Packed kernel (the one the runtime runs over 512 tokens on large matrices), at Llama-3.2-1B's
 * and Qwen3-4B's gate/up shapes: it ran at 40-54 TOPS on the H200 against the ~130 session 9's probe implies, and
 * operand loads four words at a time did not speed it up (bench/journal.md, session 17).
 */
const DOT4_ABLATIONS: [string, (code: string) => string][] = [
  ['full', (code) => code],
  // Each product replaced by an integer add of one operand: the products' own cost.
  [
    'no-products (an add instead)',
    (code) => code.replaceAll(/\+= dot4I8Packed\(wv\[i\], xv\[j\]\);/g, '+= bitcast<i32>(wv[i]);'),
  ],
  // The per-block scale application: the integer sums' conversion, the scales' loads and the multiply-adds. (Both
  // halves' sums of a Q6_K block stay used, or the compiler could drop half the products.)
  [
    'no-apply (sums added as bits)',
    (code) =>
      code.replaceAll(
        /acc\[i \* 4u \+ j\] \+= [^;]*;/g,
        code.includes('var high')
          ? 'acc[i * 4u + j] += bitcast<f32>(sums[i * 4u + j] + high[i * 4u + j]);'
          : 'acc[i * 4u + j] += bitcast<f32>(sums[i * 4u + j]);',
      ),
  ],
  // Only the integer-to-float conversion of the sums (NVIDIA runs it at a fraction of the multiply-add rate).
  [
    'no-convert (sums reinterpreted)',
    (code) =>
      code
        .replaceAll('f32(sums[i * 4u + j])', 'bitcast<f32>(sums[i * 4u + j])')
        .replaceAll('f32(high[i * 4u + j])', 'bitcast<f32>(high[i * 4u + j])'),
  ],
  [
    'magic-convert',
    (code) =>
      code.replaceAll(/f32\((sums\[[^\]]*\])\)/g, MAGIC_CONVERT).replaceAll(/f32\((high\[[^\]]*\])\)/g, MAGIC_CONVERT),
  ],
  // The weight codes read as raw words: no nibble decode (the loads stay).
  [
    'no-weight-decode (raw words)',
    (code) =>
      code.replace(
        '= code_word(min(n0 + r, params.rows - 1u) * params.rowWords, blk, word);',
        '= w[min(n0 + r, params.rows - 1u) * params.rowWords + blk * 4u + word];',
      ),
  ],
  // No global loads of codes: staged values made from indices (the scales still load; one word of the activation
  // codes is still read, or the unused binding would leave the bind group invalid).
  [
    'no-code-loads',
    (code) =>
      code
        .replace('= code_word(min(n0 + r, params.rows - 1u) * params.rowWords, blk, word);', '= n0 + r + blk + word;')
        .replace('= codes[(t0 + r) * (K / 4u) + blk * 8u + word];', '= r + blk + codes[0];'),
  ],
  // Operands from registers instead of workgroup memory.
  [
    'no-operand-reads',
    (code) =>
      code
        .replaceAll('wv[i] = wcodes[(lid.x + 16u * i) * ROW_WORDS + k];', 'wv[i] = lid.x + i + k;')
        .replaceAll('xv[i] = xcodes[(lid.y + 16u * i) * ROW_WORDS + k];', 'xv[i] = lid.y + i + k;'),
  ],
  ['no-barriers', (code) => code.replaceAll('workgroupBarrier();', '')],
];

/** Schedules of the dot4I8Packed kernel compared by `--schedules` (DOT4_SCHEDULE, the runtime's, is 2 blocks). */
const DOT4_SCHEDULES: [string, Dot4Schedule][] = [
  ['1 block', { blocksPerStage: 1 }],
  ['2 blocks', { blocksPerStage: 2 }],
];

/**
 * Each schedule of DOT4_SCHEDULES through the dot4I8Packed cases of kernels/matmul-int8.test.ts, then timed at
 * Qwen3-4B's and Llama-3.2-1B's gate/up and down shapes over 1024 tokens (the runtime's prefill chunk there).
 */
async function compareSchedules(gpu: Awaited<ReturnType<typeof acquireGpu>>): Promise<number> {
  let failed = 0;
  const build = (type: GgmlType, schedule: Dot4Schedule) => (code: string) =>
    int8DotMatmulWgsl(type, code.includes('var<storage, read> bias'), code.includes('y[at] = y[at] +'), schedule);
  for (const [name, schedule] of DOT4_SCHEDULES) {
    for (const [typeName, type, K] of INT8_MATMUL_TYPES) {
      for (const c of int8MatmulCasesFor(type).filter((c) => c.variant === 'dot4')) {
        const r = await runInt8MatmulCase(gpu, type, K, c, build(type, schedule));
        const pass = r.error <= 1 && r.codeDistance <= 1;
        if (!pass) failed++;
        console.log(
          `${pass ? 'ok  ' : 'FAIL'} schedule '${name}' ${typeName} K=${K} N=${c.rows} T=${c.tokens}: error ${r.error.toFixed(3)}`,
        );
      }
    }
  }
  const tokens = 1024;
  const random = seededRandom(11);
  const shapes: [GgmlType, number, number][] = [
    [GgmlType.Q4_K, 2560, 9728],
    [GgmlType.Q4_K, 9728, 2560],
    [GgmlType.Q6_K, 9728, 2560],
    [GgmlType.Q4_0, 2048, 8192],
    [GgmlType.Q4_K, 2560, 4096],
  ];
  for (const [type, K, N] of shapes) {
    const weight = uploadWeightFromBytes(gpu, 'w', type, [K, N], randomWeightBytes(type, K * N, random));
    const input = gpu.allocator.createStorage('x', 'scratch', randomFloats(random, tokens * K, 1));
    const output = gpu.allocator.createStorage('y', 'scratch', tokens * N * 4);
    const activations = createInt8Activations(gpu, 'int8', tokens, K);
    // Real activation codes (the matmul's time does not depend on them, but its outputs stay finite).
    const quantize = prepareQuantizeActivations(gpu, 'quantize', { input, activations, tokens, K });
    submitDispatches(gpu, 'quantize', [quantize]);
    releaseDispatches(gpu, [quantize]);
    let line = `schedules ${GGML_TYPE_INFO[type]?.name} ${K}x${N} T=${tokens}:`;
    for (const [name, schedule] of DOT4_SCHEDULES) {
      // The schedule's build on a view of the device (one of them is the kernel as built: mayKeep).
      const rebuilt = mutateShaders(gpu, { label: 'matmul-int8 dot4', edit: build(type, schedule), mayKeep: true });
      const int8 = prepareInt8Matmul(rebuilt.gpu, 'int8', { weight, activations, output, tokens }, 'dot4');
      const ms = await timeDispatches(gpu, int8, 20);
      line += ` '${name}' ${(ms * 1000).toFixed(1)} µs (${((2 * N * K * tokens) / ms / 1e9).toFixed(1)} TOPS);`;
      releaseDispatches(gpu, int8);
    }
    gpu.throwIfErrors();
    console.log(line);
    releaseInt8Activations(gpu, activations);
    gpu.allocator.release(input);
    gpu.allocator.release(output);
    releaseWeight(gpu, weight);
  }
  return failed;
}

async function ablate(gpu: Awaited<ReturnType<typeof acquireGpu>>) {
  const tokens = 512;
  const random = seededRandom(5);
  // [weights, K, N, kernels]: Llama-3.2-1B's gate/up for every kernel, Qwen3-4B's for dot4I8Packed.
  const everyKernel: Int8MatmulVariant[] = [...(Object.keys(INT8_MATMUL_TILES) as Int8MatmulVariant[]), 'dot4'];
  const runs: [GgmlType, number, number, Int8MatmulVariant[]][] = [
    [GgmlType.Q4_0, 2048, 8192, everyKernel],
    [GgmlType.Q4_K, 2048, 8192, everyKernel],
    [GgmlType.Q4_K, 2560, 9728, ['dot4']],
    [GgmlType.Q6_K, 2560, 9728, ['dot4']],
  ];
  for (const [type, K, N, variants] of runs) {
    const weight = uploadWeightFromBytes(gpu, 'w', type, [K, N], randomWeightBytes(type, K * N, random));
    const input = gpu.allocator.createStorage('x', 'scratch', randomFloats(random, tokens * K, 1));
    const output = gpu.allocator.createStorage('y', 'scratch', tokens * N * 4);
    const activations = createInt8Activations(gpu, 'int8', tokens, K);
    const quantize = prepareQuantizeActivations(gpu, 'quantize', { input, activations, tokens, K });
    for (const variant of variants) {
      for (const [name, transform] of variant === 'dot4' ? DOT4_ABLATIONS : ABLATIONS) {
        // 'full' is the kernel as built; every other ablation must change it (mutateShaders throws otherwise).
        const ablated = mutateShaders(gpu, { label: /^matmul-int8 /, edit: transform, mayKeep: name === 'full' });
        const int8 = prepareInt8Matmul(ablated.gpu, 'int8', { weight, activations, output, tokens }, variant);
        const ms = await timeDispatches(gpu, int8, 20);
        console.log(
          `ablation ${GGML_TYPE_INFO[type]?.name} ${K}x${N} ${variant} ${name}: ${(ms * 1000).toFixed(1)} µs (${((2 * N * K * tokens) / ms / 1e9).toFixed(1)} TF)`,
        );
        releaseDispatches(gpu, int8);
      }
    }
    gpu.throwIfErrors();
    releaseDispatches(gpu, [quantize]);
    releaseInt8Activations(gpu, activations);
    gpu.allocator.release(input);
    gpu.allocator.release(output);
    releaseWeight(gpu, weight);
  }
}

async function main() {
  const gpu = await acquireGpu({ gpu: await nodeGpu() });
  const a = gpu.adapter;
  console.log(`adapter: ${a.vendor} ${a.device} (${a.description}); features ${JSON.stringify(gpu.features)}`);
  console.log(`maxComputeWorkgroupStorageSize ${gpu.limits.maxComputeWorkgroupStorageSize}`);
  const result: Record<string, unknown> = {
    date: new Date().toISOString(),
    commit: process.env.LONGTAB_BENCH_COMMIT ?? 'unknown',
    adapter: a,
    features: gpu.features,
  };
  if (!gpu.features.subgroupMatrixI8) {
    console.log('this adapter has no i8 subgroup matrices: nothing to run');
    process.exitCode = 1;
    return;
  }
  let failed = 0;
  if (!process.argv.includes('--skip-check')) {
    const checks = [];
    for (const [name, type, K] of INT8_MATMUL_TYPES) {
      for (const c of int8MatmulCasesFor(type)) {
        const r = await runInt8MatmulCase(gpu, type, K, c);
        gpu.throwIfErrors();
        const pass = r.error <= 1 && r.codeDistance <= 1;
        if (!pass) failed++;
        checks.push({ type: name, K, ...c, ...r, pass });
        console.log(
          `${pass ? 'ok  ' : 'FAIL'} ${name} K=${K} N=${c.rows} T=${c.tokens} ${c.variant}${c.bias ? ' bias' : ''}` +
            `${c.accumulate ? ' acc' : ''}${c.maxRowsPerPart ? ` parts<=${c.maxRowsPerPart}` : ''}: error ${r.error.toFixed(3)}, ` +
            `codes ±${r.codeDistance} (${r.codeMismatches}), int8 vs f32 activations ${r.quantizationError.toExponential(2)}`,
        );
      }
    }
    result.checks = checks;
    console.log(`${checks.length - failed}/${checks.length} checks pass`);
  }
  if (process.argv.includes('--ablate')) await ablate(gpu);
  if (process.argv.includes('--schedules')) failed += await compareSchedules(gpu);
  if (process.argv.includes('--skip-timing')) {
    if (failed) process.exitCode = 1;
    return;
  }
  const tokensList = (arg('--tokens') ?? '128,512').split(',').map(Number);
  const variants = INT8_MATMUL_VARIANTS;
  const timings = [];
  const types = (arg('--types') ?? 'Q4_K,Q4_0,Q6_K').split(',').map((name) => {
    const type = GgmlType[name.toUpperCase() as keyof typeof GgmlType];
    if (type === undefined) throw new Error(`--types: unknown weight type ${name}`);
    return type;
  });
  for (const weightType of types) {
    for (const [model, matrix, K, N] of SHAPES) {
      // K-quants need rows of whole 256-element blocks (llama.cpp quantizes Qwen2.5-0.5B's 896 otherwise).
      if ((GGML_TYPE_INFO[weightType]?.blockSize ?? 32) === 256 && K % 256 !== 0) continue;
      const random = seededRandom(K * 7 + N);
      const weight = uploadWeightFromBytes(gpu, 'w', weightType, [K, N], randomWeightBytes(weightType, K * N, random));
      for (const tokens of tokensList) {
        const input = gpu.allocator.createStorage('x', 'scratch', randomFloats(random, tokens * K, 1));
        const output = gpu.allocator.createStorage('y', 'scratch', tokens * N * 4);
        const activations = createInt8Activations(gpu, 'int8', tokens, K);
        const f32 = prepareMatmul(gpu, 'f32', { weight, input, output, tokens });
        const reps = 20;
        const f32Ms = await timeDispatches(gpu, f32, reps);
        const quantize = prepareQuantizeActivations(gpu, 'quantize', { input, activations, tokens, K });
        const quantizeMs = await timeDispatches(gpu, [quantize], reps);
        const row: Record<string, unknown> = {
          weights: GGML_TYPE_INFO[weightType]?.name,
          model,
          matrix,
          K,
          N,
          tokens,
          f32Variant: defaultMatmulVariant(N, tokens),
          f32Us: f32Ms * 1000,
          quantizeUs: quantizeMs * 1000,
          defaultInt8: defaultInt8Variant(gpu, weight, tokens),
        };
        const flops = 2 * N * K * tokens;
        let line = `${row.weights} ${model} ${matrix} ${K}x${N} T=${tokens}: f32 ${(f32Ms * 1000).toFixed(1)} µs (${(flops / f32Ms / 1e9).toFixed(1)} TF), quantize ${(quantizeMs * 1000).toFixed(1)} µs`;
        for (const variant of variants.filter((v) => int8MatmulSupportsType(weightType, v))) {
          const int8 = prepareInt8Matmul(gpu, 'int8', { weight, activations, output, tokens }, variant);
          const ms = await timeDispatches(gpu, [quantize, ...int8], reps);
          row[`int8_${variant}Us`] = ms * 1000;
          line += `, ${variant} ${(ms * 1000).toFixed(1)} µs (${(flops / ms / 1e9).toFixed(1)} TF, ${(f32Ms / ms).toFixed(2)}x)`;
          releaseDispatches(gpu, int8);
        }
        gpu.throwIfErrors();
        console.log(line);
        timings.push(row);
        releaseDispatches(gpu, [...f32, quantize]);
        releaseInt8Activations(gpu, activations);
        gpu.allocator.release(input);
        gpu.allocator.release(output);
      }
      releaseWeight(gpu, weight);
    }
  }
  result.timings = timings;
  const out = arg('--out');
  if (out) writeFileSync(out, `${JSON.stringify(result, null, 2)}\n`);
  if (failed) process.exitCode = 1;
  gpu.destroy();
  releaseNodeGpu();
}

await main();

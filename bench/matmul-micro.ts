/**
 * Micro-benchmark of the tiled matmul (tokens > 1, the prefill path) per variant: every MATMUL_VARIANTS entry plus
 * '64x64-noprefetch' (the 64x64 register tile without the register prefetch; bench only). For each weight type,
 * shape (N rows x K) and token count it times `--reps` dispatches recorded in one compute pass and one submit, from
 * `queue.submit` to `onSubmittedWorkDone`, minus the median round trip of an empty submit, divided by the count; the
 * median of `--samples` such submits after one warm-up submit. Every variant's output is checked against an f64 CPU
 * reference on a sample of outputs (first, middle and last token; first, last and random rows), with the tolerance of
 * kernels/matmul.test.ts (1e-4 of Σ|w·x| per output). Prints a markdown table (and writes it with --out).
 *
 *   npx tsx bench/matmul-micro.ts --quick                  # tiny shapes, here on lavapipe (seconds)
 *   npx tsx bench/matmul-micro.ts [--types Q4_0,Q6_K] [--shapes 2048x2048,8192x2048] [--tokens 128,512]
 *                                 [--variants 32x32,64x64] [--reps 20] [--samples 7] [--out result.md]
 *   npm run bench:matmul-micro:bundle                      # -> .gpu/matmul-micro.mjs (webgpu external)
 *
 * On the GPU host (no Node: the kit in .gpu/kit.tar.xz, see BENCH.md), carrying .gpu/kit.tar.xz and
 * .gpu/matmul-micro.mjs; the markdown is rewritten after every row, so a killed run keeps what it measured:
 *
 *   ( [ -x /tmp/kit/run.sh ] || tar xJf .gpu/kit.tar.xz -C /tmp ) && /tmp/kit/run.sh .gpu/matmul-micro.mjs \
 *     --out $OUT/matmul-micro.md > $OUT/matmul-micro.log 2>&1; tail -50 $OUT/matmul-micro.log
 *
 * Check the bundle here first with the kit's own node: unpack the kit to a temp dir, copy the bundle next to its
 * node_modules and run `kit/bin/node kit/matmul-micro.mjs --quick` (run.sh itself installs the kit's Vulkan loader
 * into /, for the host only).
 *
 * Weights are random valid blocks (kernels/reference/dequantize.ts), which run at the speed of real ones: the
 * kernels do not branch on values.
 */
import { execFileSync } from 'node:child_process';
import { writeFileSync } from 'node:fs';
import { cpus } from 'node:os';
import { GGML_TYPE_INFO, GgmlType } from '../core/gguf-types.ts';
import { acquireGpu, type GpuContext } from '../core/gpu/device.ts';
import { encodeDispatches, type PreparedDispatch, releaseDispatches } from '../core/gpu/dispatch.ts';
import { nodeGpu, releaseNodeGpu } from '../core/gpu/node.ts';
import { readFloat32 } from '../core/gpu/readback.ts';
import { matvecThreadsFor, prepareMatmul } from '../kernels/matmul.ts';
import {
  MATMUL_TILES,
  MATMUL_VARIANTS,
  type MatmulVariant,
  matvecBuildFor,
  matvecWgsl,
  registerTiledMatmulWgsl,
  withWeightHelpers,
} from '../kernels/matmul.wgsl.ts';
import { dequantize, randomWeightBytes } from '../kernels/reference/dequantize.ts';
import { rawRowBytes, releaseWeight, uploadWeightFromBytes } from '../kernels/weights.ts';
import { randomFloats, seededRandom } from '../test/random.ts';
import { mutateShaders } from '../test/shader-mutation.ts';

const RTOL = 1e-4;
const ATOL = 1e-6;

interface BenchVariant {
  name: string;
  variant: MatmulVariant;
  /**
   * Replaces the variant's WGSL (same tile shape, so the same dispatch grid); K is the row length. Null: the variant
   * does not apply to this type (its cell reads '–').
   */
  code?: (type: GgmlType, hasBias: boolean, K: number, gpu: GpuContext) => string | null;
  /** What the variant is, for the table's footer (matvec variants). */
  about?: string;
  /** An ablation: its results are wrong by design, and the check column leaves it out. */
  ablation?: boolean;
}

const BENCH_VARIANTS: BenchVariant[] = [
  ...MATMUL_VARIANTS.map((variant) => ({ name: variant, variant })),
  {
    name: '64x64-noprefetch',
    variant: '64x64',
    code: (type, hasBias) => registerTiledMatmulWgsl(type, hasBias, { ...MATMUL_TILES['64x64'], prefetch: false }),
  },
];

/**
 * Session 13's Q4_K unit: one-word loads, scales through scale_min_k4 (experiment baseline; not the runtime's). Its
 * helpers come from withWeightHelpers.
 */
const Q4K_WORD_DOT = `fn unit_dot(base: u32, u: u32, xb: u32) -> f32 {
  let b = u / 8u; let j = u % 8u; let c = j / 2u;
  let wb = base + b * 36u; let qw = wb + 4u + 4u * j; let xk = xb + b * 256u + 64u * c + 16u * (j % 2u);
  let q0 = w[qw]; let q1 = w[qw + 1u]; let q2 = w[qw + 2u]; let q3 = w[qw + 3u];
  let dm = unpack2x16float(w[wb]);
  let s1 = scale_min_k4(wb, 2u * c); let s2 = scale_min_k4(wb, 2u * c + 1u);
  let l0 = xv(xk); let l1 = xv(xk + 4u); let l2 = xv(xk + 8u); let l3 = xv(xk + 12u);
  let h0 = xv(xk + 32u); let h1 = xv(xk + 36u); let h2 = xv(xk + 40u); let h3 = xv(xk + 44u);
  let m = 0x0f0f0f0fu;
  let lo = dot(bytes4(q0 & m), l0) + dot(bytes4(q1 & m), l1) + dot(bytes4(q2 & m), l2) + dot(bytes4(q3 & m), l3);
  let hi = dot(bytes4((q0 >> 4u) & m), h0) + dot(bytes4((q1 >> 4u) & m), h1) + dot(bytes4((q2 >> 4u) & m), h2)
         + dot(bytes4((q3 >> 4u) & m), h3);
  return dm.x * (s1.x * lo + s2.x * hi) - dm.y * (s1.y * hsum(l0 + l1 + l2 + l3) + s2.y * hsum(h0 + h1 + h2 + h3));
}`;

/** Ablation: the runtime's Q4_K loads (header and quant vec4s, x) with almost no arithmetic (wrong results). */
const Q4K_LOADS_ONLY_DOT = `fn unit_dot(base: u32, u: u32, xb: u32) -> f32 {
  let b = u / 8u; let j = u % 8u; let c = j / 2u;
  let wb = base / 4u + b * 9u; let xk = xb + b * 256u + 64u * c + 16u * (j % 2u);
  let v = w[wb] ^ w[wb + 1u + j];
  let x = xv(xk) + xv(xk + 4u) + xv(xk + 8u) + xv(xk + 12u) + xv(xk + 32u) + xv(xk + 36u) + xv(xk + 40u) + xv(xk + 44u);
  return bitcast<f32>((v.x ^ v.y ^ v.z ^ v.w) & 0x3fffffffu) * hsum(x);
}`;

/**
 * The 4 rows of a unit with x loaded once for them (the runtime kernel calls unit_dot per row and leaves sharing the
 * x loads to the compiler). Same arithmetic per row as the runtime's Q4_K unit.
 */
const Q4K_SHARED_X_DOT = `fn q4k_row(base: u32, b: u32, j: u32, c: u32, lx: array<vec4<f32>, 8>, ls: f32, hs: f32) -> f32 {
  let wb = base / 4u + b * 9u;
  let h = w[wb]; let q = w[wb + 1u + j];
  let dm = unpack2x16float(h.x);
  let s = k4_scales(h, c);
  let m = 0x0f0f0f0fu;
  let lo = dot(bytes4(q.x & m), lx[0]) + dot(bytes4(q.y & m), lx[1]) + dot(bytes4(q.z & m), lx[2]) + dot(bytes4(q.w & m), lx[3]);
  let hi = dot(bytes4((q.x >> 4u) & m), lx[4]) + dot(bytes4((q.y >> 4u) & m), lx[5]) + dot(bytes4((q.z >> 4u) & m), lx[6])
         + dot(bytes4((q.w >> 4u) & m), lx[7]);
  return dm.x * (s.x * lo + s.y * hi) - dm.y * (s.z * ls + s.w * hs);
}
fn unit_dot4(b0: u32, b1: u32, b2: u32, b3: u32, u: u32) -> vec4<f32> {
  let b = u / 8u; let j = u % 8u; let c = j / 2u;
  let xk = b * 256u + 64u * c + 16u * (j % 2u);
  let lx = array<vec4<f32>, 8>(xv(xk), xv(xk + 4u), xv(xk + 8u), xv(xk + 12u), xv(xk + 32u), xv(xk + 36u), xv(xk + 40u), xv(xk + 44u));
  let ls = hsum(lx[0] + lx[1] + lx[2] + lx[3]); let hs = hsum(lx[4] + lx[5] + lx[6] + lx[7]);
  return vec4<f32>(q4k_row(b0, b, j, c, lx, ls, hs), q4k_row(b1, b, j, c, lx, ls, hs), q4k_row(b2, b, j, c, lx, ls, hs),
                   q4k_row(b3, b, j, c, lx, ls, hs));
}`;

/**
 * The runtime's matvec WGSL for Q4_K with its unit_dot replaced (bench experiments; null for other types): the
 * runtime's build, or session 13's (`'session13'`: tree reduction, one unit per loop iteration).
 */
function q4kVariant(dot: string, build: 'runtime' | 'session13', words: 'u32' | 'vec4', sharedX = false) {
  return (type: GgmlType, hasBias: boolean, K: number, gpu: GpuContext): string | null => {
    if (type !== GgmlType.Q4_K) return null;
    const matvecBuild = build === 'runtime' ? matvecBuildFor(gpu.features) : { subgroups: false, unroll: 1 as const };
    let code = matvecWgsl(type, hasBias, false, matvecThreadsFor(type, K), matvecBuild);
    const start = code.indexOf('fn unit_dot(');
    const end = code.indexOf('\n}\n', start) + 3;
    if (start < 0 || end < 3) throw new Error('no unit_dot in the Q4_K matvec');
    code = code.slice(0, start) + withWeightHelpers(dot) + code.slice(end);
    if (words === 'u32')
      code = code.replace('var<storage, read> w: array<vec4<u32>>;', 'var<storage, read> w: array<u32>;');
    if (sharedX) {
      // Every unit's 4 rows (vec4<f32>(unit_dot(b0, u, 0u), ..., unit_dot(b3, u, 0u))) from unit_dot4.
      const rows =
        /vec4<f32>\(unit_dot\(b0, ([^,]+), 0u\), unit_dot\(b1, \1, 0u\), unit_dot\(b2, \1, 0u\), unit_dot\(b3, \1, 0u\)\)/g;
      if (!rows.test(code)) throw new Error('no row loop in the Q4_K matvec');
      code = code.replace(rows, 'unit_dot4(b0, b1, b2, b3, $1)');
    }
    return code;
  };
}

/** Q4_K experiments (bench only): session 13's kernel, its loads alone, x shared by the 4 rows explicitly. */
function q4kExperiments(): BenchVariant[] {
  return [
    {
      name: 'q4k-prev-tree',
      variant: '32x32',
      about: 'session 13 (one-word Q4_K loads, tree reduction, one unit per iteration)',
      code: q4kVariant(Q4K_WORD_DOT, 'session13', 'u32'),
    },
    {
      name: 'q4k-prev-sg',
      variant: '32x32',
      about: 'one-word Q4_K loads in the runtime build',
      code: q4kVariant(Q4K_WORD_DOT, 'runtime', 'u32'),
    },
    {
      name: 'q4k-loads',
      variant: '32x32',
      about: 'ablation: auto’s loads without the arithmetic (wrong results)',
      ablation: true,
      code: q4kVariant(Q4K_LOADS_ONLY_DOT, 'runtime', 'vec4'),
    },
    {
      name: 'q4k-x4',
      variant: '32x32',
      about: 'auto with x loaded once for the 4 rows',
      code: q4kVariant(Q4K_SHARED_X_DOT, 'runtime', 'vec4', true),
    },
  ];
}

/**
 * --matvec (tokens = 1): the matvec kernel at a fixed thread count per workgroup ('t32'..'t256'), against 'auto', the
 * kernel the runtime builds (matvecThreadsFor, subgroup reductions where the device has them); 'tree': auto's thread
 * count, reduced over workgroup memory (the build for devices without subgroups).
 */
const MATVEC_VARIANTS: BenchVariant[] = [
  { name: 'auto', variant: '32x32', about: 'the runtime kernel (matvecThreadsFor, matvecBuildFor)' },
  {
    name: 'tree',
    variant: '32x32',
    about: 'auto reduced over workgroup memory (no subgroups)',
    code: (type, hasBias, K, gpu) =>
      matvecWgsl(type, hasBias, false, matvecThreadsFor(type, K), {
        ...matvecBuildFor(gpu.features),
        subgroups: false,
      }),
  },
  {
    name: 'u1',
    variant: '32x32',
    about: 'auto with one unit per loop iteration',
    code: (type, hasBias, K, gpu) =>
      matvecWgsl(type, hasBias, false, matvecThreadsFor(type, K), { ...matvecBuildFor(gpu.features), unroll: 1 }),
  },
  ...q4kExperiments(),
  ...[32, 64, 96, 128, 256].map(
    (threads): BenchVariant => ({
      name: `t${threads}`,
      variant: '32x32',
      code: (type, hasBias, _K, gpu) => matvecWgsl(type, hasBias, false, threads, matvecBuildFor(gpu.features)),
    }),
  ),
];

const TYPES: Record<string, GgmlType> = {
  F32: GgmlType.F32,
  F16: GgmlType.F16,
  BF16: GgmlType.BF16,
  Q4_0: GgmlType.Q4_0,
  Q4_1: GgmlType.Q4_1,
  Q5_0: GgmlType.Q5_0,
  Q5_1: GgmlType.Q5_1,
  Q8_0: GgmlType.Q8_0,
  Q4_K: GgmlType.Q4_K,
  Q5_K: GgmlType.Q5_K,
  Q6_K: GgmlType.Q6_K,
};

interface Options {
  types: string[];
  /** [rows N, K] */
  shapes: [number, number][];
  tokens: number[];
  variants: BenchVariant[];
  reps: number;
  samples: number;
  out: string | undefined;
  quick: boolean;
  matvec: boolean;
  /** Copies of each weight, dispatched in turn: enough of them that the weights stream from memory, not L2. */
  copies: number;
}

const USAGE = `Usage: npx tsx bench/matmul-micro.ts [flags]   (on the GPU host: /tmp/kit/run.sh .gpu/matmul-micro.mjs [flags])
  --matvec          tokens = 1: the matvec at fixed thread counts (${MATVEC_VARIANTS.map((v) => v.name).join(',')})
  --quick           tiny shapes (N x K 96x256, 300x512; 33 and 70 tokens), 3 reps, 3 samples
  --types list      ${Object.keys(TYPES).join(',')} (default Q4_0,Q4_K,Q6_K,Q8_0)
  --shapes list     N x K (rows x row length), default 2048x2048,8192x2048,2048x8192,128256x2048
  --tokens list     default 128,512
  --variants list   ${BENCH_VARIANTS.map((v) => v.name).join(',')} (default: all)
  --reps n          dispatches per submit (default 20)
  --copies n        copies of each weight, dispatched in turn (default 1: the weight stays in L2 where it fits;
                    the H200's L2 is 50 MB, so 8 copies of a 14 MB weight stream from memory as a model's do)
  --samples n       timed submits per cell, median reported (default 7)
  --out file        also write the markdown there`;

function parseArgs(argv: string[]): Options {
  const quick = argv.includes('--quick');
  const matvec = argv.includes('--matvec');
  const value = (flag: string): string | undefined => {
    const i = argv.indexOf(flag);
    if (i < 0) return undefined;
    const v = argv[i + 1];
    if (v === undefined || v.startsWith('--')) throw new Error(`${flag} needs a value\n${USAGE}`);
    return v;
  };
  const list = (flag: string, fallback: string): string[] => (value(flag) ?? fallback).split(',').filter(Boolean);
  const known = new Set([
    '--matvec',
    '--quick',
    '--types',
    '--shapes',
    '--tokens',
    '--variants',
    '--reps',
    '--copies',
    '--samples',
    '--out',
  ]);
  for (const a of argv) {
    if (a === '--help' || a === '-h') {
      console.log(USAGE);
      process.exit(0);
    }
    if (a.startsWith('--') && !known.has(a)) throw new Error(`unknown flag ${a}\n${USAGE}`);
  }
  const types = list('--types', 'Q4_0,Q4_K,Q6_K,Q8_0');
  for (const t of types) if (!(t in TYPES)) throw new Error(`unknown type ${t}\n${USAGE}`);
  const shapes = list('--shapes', quick ? '96x256,300x512' : '2048x2048,8192x2048,2048x8192,128256x2048').map(
    (s): [number, number] => {
      const [n, k] = s.split('x').map(Number);
      if (!(n > 0 && k > 0)) throw new Error(`bad shape ${s} (want NxK)`);
      return [n, k];
    },
  );
  const tokens = matvec ? [1] : list('--tokens', quick ? '33,70' : '128,512').map(Number);
  if (!matvec && tokens.some((t) => !(Number.isInteger(t) && t > 1)))
    throw new Error('--tokens: integers > 1 (tokens = 1 is the matvec: --matvec)');
  const table = matvec ? MATVEC_VARIANTS : BENCH_VARIANTS;
  const names = list('--variants', table.map((v) => v.name).join(','));
  const variants = names.map((n) => {
    const v = table.find((b) => b.name === n);
    if (!v) throw new Error(`unknown variant ${n}\n${USAGE}`);
    return v;
  });
  const int = (flag: string, fallback: number) => {
    const n = Number(value(flag) ?? fallback);
    if (!(Number.isInteger(n) && n > 0)) throw new Error(`${flag}: a positive integer`);
    return n;
  };
  return {
    types,
    shapes,
    tokens,
    variants,
    reps: int('--reps', quick ? 3 : 20),
    copies: int('--copies', 1),
    samples: int('--samples', quick ? 3 : 7),
    out: value('--out'),
    quick,
    matvec,
  };
}

function median(values: number[]): number {
  const s = [...values].sort((a, b) => a - b);
  const m = s.length >> 1;
  return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2;
}

/** Milliseconds from submit to onSubmittedWorkDone of one command buffer. */
async function timeSubmit(gpu: GpuContext, record: (pass: GPUComputePassEncoder) => void): Promise<number> {
  const encoder = gpu.device.createCommandEncoder({ label: 'matmul-micro' });
  const pass = encoder.beginComputePass({ label: 'matmul-micro' });
  record(pass);
  pass.end();
  const commands = encoder.finish();
  const t0 = performance.now();
  gpu.device.queue.submit([commands]);
  await gpu.device.queue.onSubmittedWorkDone();
  return performance.now() - t0;
}

interface Sample {
  t: number;
  n: number;
  y: number;
  magnitude: number;
}

/** f64 references for a few outputs: tokens first/middle/last, rows first 4, last 4 and 24 random ones. */
function referenceSamples(type: GgmlType, raw: Uint8Array, x: Float32Array, N: number, K: number, T: number) {
  const random = seededRandom(N * 31 + K + T);
  const rows = new Set<number>();
  for (let i = 0; i < Math.min(4, N); i++) rows.add(i).add(N - 1 - i);
  while (rows.size < Math.min(N, 32)) rows.add(Math.floor(random() * N));
  const rowBytes = rawRowBytes(type, K);
  const tokens = [...new Set([0, T >> 1, T - 1])];
  const samples: Sample[] = [];
  for (const n of rows) {
    const w = dequantize(type, raw.subarray(n * rowBytes, (n + 1) * rowBytes), K);
    for (const t of tokens) {
      let y = 0;
      let magnitude = 0;
      for (let k = 0; k < K; k++) {
        const p = w[k] * x[t * K + k];
        y += p;
        magnitude += Math.abs(p);
      }
      samples.push({ t, n, y, magnitude });
    }
  }
  return { tokens, samples };
}

/** Largest |gpu − reference| / (atol + rtol·Σ|w·x|) over the samples (<= 1: within the tests' tolerance). */
async function checkOutput(
  gpu: GpuContext,
  output: GPUBuffer,
  N: number,
  ref: ReturnType<typeof referenceSamples>,
): Promise<number> {
  const rows = new Map<number, Float32Array>();
  for (const t of ref.tokens) rows.set(t, await readFloat32(gpu, output, N, t * N));
  let worst = 0;
  for (const s of ref.samples) {
    const r = Math.abs(rows.get(s.t)![s.n] - s.y) / (ATOL + RTOL * s.magnitude);
    if (!(r <= worst)) worst = Number.isNaN(r) ? Number.POSITIVE_INFINITY : r;
  }
  return worst;
}

interface Cell {
  variant: string;
  /** Median µs per dispatch (round trip subtracted), or null when it failed. */
  us: number | null;
  error: number;
  note?: string;
}

interface Row {
  type: string;
  N: number;
  K: number;
  tokens: number;
  cells: Cell[];
}

function shapeName(N: number, K: number) {
  return `${N}×${K}`;
}

function formatRow(r: Row, variants: BenchVariant[], baseline: string): string {
  const flops = 2 * r.N * r.K * r.tokens;
  const base = r.cells.find((c) => c.variant === baseline)?.us ?? null;
  const cells = variants.map(({ name }) => {
    const c = r.cells.find((x) => x.variant === name);
    if (!c || c.us === null) return c?.note ?? '–';
    const rate =
      r.tokens === 1
        ? `${((rawRowBytes(TYPES[r.type], r.K) * r.N) / (c.us * 1e-6) / 1e9).toFixed(0)} GB/s`
        : `${(flops / (c.us * 1e-6) / 1e12).toPrecision(3)} TF`;
    const speedup = base ? ` ${(base / c.us).toFixed(2)}×` : '';
    return `${c.us < 100 ? c.us.toFixed(1) : c.us.toFixed(0)} µs ${rate}${speedup}${c.error > 1 ? ' **WRONG**' : ''}`;
  });
  const timed = r.cells.filter((c) => c.us !== null);
  const best = timed.length ? timed.reduce((a, b) => (b.us! < a.us! ? b : a)) : null;
  const checked = r.cells.filter((c) => !variants.find((v) => v.name === c.variant)?.ablation);
  const worst = Math.max(0, ...checked.map((c) => c.error));
  const check = worst <= 1 ? `ok (${worst.toFixed(3)})` : `FAIL (${worst.toPrecision(3)})`;
  return `| ${r.type} | ${shapeName(r.N, r.K)} | ${r.tokens} | ${cells.join(' | ')} | ${best?.variant ?? '–'} | ${check} |`;
}

function commit(): string {
  if (process.env.LONGTAB_BENCH_COMMIT) return process.env.LONGTAB_BENCH_COMMIT;
  try {
    const opts = { encoding: 'utf8' as const, stdio: ['ignore', 'pipe', 'ignore'] as ['ignore', 'pipe', 'ignore'] };
    const head = execFileSync('git', ['rev-parse', '--short=12', 'HEAD'], opts).trim();
    const files = ['kernels/matmul.ts', 'kernels/matmul.wgsl.ts', 'bench/matmul-micro.ts'];
    const dirty = execFileSync('git', ['status', '--porcelain', '--untracked-files=no', '--', ...files], opts).trim();
    return `${head}${dirty ? '+matmul-dirty' : ''}`;
  } catch {
    return 'unknown';
  }
}

async function main() {
  const o = parseArgs(process.argv.slice(2));
  const gpu = await acquireGpu({ gpu: await nodeGpu() });
  const a = gpu.adapter;
  const features = Object.entries(gpu.features)
    .filter(([, on]) => on)
    .map(([f]) => f);
  const header = [
    `# ${o.matvec ? 'Matvec' : 'Tiled matmul'} micro-benchmark ${new Date().toISOString()}, commit ${commit()}`,
    '',
    `Adapter: ${a.vendor} ${a.architecture} ${a.device} (${a.description})${a.isFallbackAdapter ? ' [fallback]' : ''}; ` +
      `subgroups ${a.subgroupMinSize ?? '?'}–${a.subgroupMaxSize ?? '?'}; device features: ${features.join(', ') || 'none'}; ` +
      `maxComputeWorkgroupStorageSize ${gpu.limits.maxComputeWorkgroupStorageSize}, ` +
      `maxStorageBufferBindingSize ${(gpu.limits.maxStorageBufferBindingSize / 2 ** 20).toFixed(0)} MiB.`,
    `Host: ${cpus()[0]?.model ?? '?'} (${cpus().length} cores), Node ${process.version}.`,
  ];
  // Round trip of an empty submit: subtracted from every timed submit.
  await timeSubmit(gpu, () => {});
  const empty: number[] = [];
  for (let i = 0; i < 15; i++) empty.push(await timeSubmit(gpu, () => {}));
  const emptyMs = median(empty);
  header.push(
    `Protocol: ${o.reps} dispatches per submit (one compute pass), median of ${o.samples} submits after one warm-up ` +
      `submit, ${o.copies > 1 ? `${o.copies} copies of each weight dispatched in turn, ` : ''}timed submit → onSubmittedWorkDone minus the empty-submit round trip (${(emptyMs * 1000).toFixed(0)} µs), ` +
      `÷ ${o.reps}. Cells: µs per dispatch, ${o.matvec ? 'GB/s of weight bytes, speedup over auto (the runtime’s thread count)' : 'TFLOPS (2·N·K·tokens), speedup over 32x32'}. N×K = weight rows × row ` +
      `length; check: largest error over sampled outputs in units of the tests' tolerance (<= 1 passes), all variants.`,
    '',
  );
  const names = o.variants.map((v) => v.name);
  const tableHead = [
    `| type | N×K | tokens | ${names.join(' | ')} | best | check |`,
    `| --- | --- | ---: | ${names.map(() => '---:').join(' | ')} | --- | --- |`,
  ];
  console.log([...header, ...tableHead].join('\n'));
  const lines: string[] = [];
  const write = () => {
    if (o.out) writeFileSync(o.out, `${[...header, ...tableHead, ...lines].join('\n')}\n`);
  };
  write();

  for (const typeName of o.types) {
    const type = TYPES[typeName];
    const blockSize = GGML_TYPE_INFO[type]?.blockSize ?? 1;
    for (const [N, K] of o.shapes) {
      if (K % blockSize !== 0) {
        console.error(`skip ${typeName} ${shapeName(N, K)}: K is not a multiple of the block (${blockSize})`);
        continue;
      }
      const t0 = performance.now();
      const raw = randomWeightBytes(type, N * K, seededRandom(N + K + type));
      const weights = Array.from({ length: o.copies }, (_, i) =>
        uploadWeightFromBytes(gpu, `w.${typeName}.${i}`, type, [K, N], raw),
      );
      const genS = (performance.now() - t0) / 1000;
      for (const T of o.tokens) {
        const x = randomFloats(seededRandom(T * 7 + K), T * K, 1);
        const input = gpu.allocator.createStorage('x', 'scratch', x);
        const output = gpu.allocator.createStorage('y', 'scratch', T * N * 4);
        const ref = referenceSamples(type, raw, x, N, K, T);
        const row: Row = { type: typeName, N, K, tokens: T, cells: [] };
        for (const v of o.variants) {
          const copies: PreparedDispatch[][] = [];
          const variantCode = v.code?.(type, false, K, gpu);
          if (variantCode === null) {
            row.cells.push({ variant: v.name, us: null, error: 0, note: '–' });
            continue;
          }
          try {
            // A variant with its own code compiles it on a view of the device (mutateShaders) in place of the build.
            const target = variantCode
              ? mutateShaders(gpu, { label: /^mat(mul|vec)\b/, edit: () => variantCode, mayKeep: true }).gpu
              : gpu;
            for (const weight of weights) {
              copies.push(
                prepareMatmul(target, `mm.${v.name}`, { weight, input, output, tokens: T }, { variant: v.variant }),
              );
            }
            // Every copy writes the same y (same weights), so the check reads whichever ran last.
            const record = (reps: number) => (pass: GPUComputePassEncoder) => {
              for (let i = 0; i < reps; i++) encodeDispatches(pass, copies[i % copies.length]);
            };
            // Clear y first so a variant that writes nothing cannot pass on the previous one's results.
            const clear = gpu.device.createCommandEncoder();
            clear.clearBuffer(output);
            gpu.device.queue.submit([clear.finish()]);
            await timeSubmit(gpu, record(1));
            const error = await checkOutput(gpu, output, N, ref);
            await timeSubmit(gpu, record(o.reps)); // warm-up
            const ms: number[] = [];
            for (let s = 0; s < o.samples; s++) ms.push(await timeSubmit(gpu, record(o.reps)));
            gpu.throwIfErrors();
            const us = (Math.max(0, median(ms) - emptyMs) * 1000) / o.reps;
            row.cells.push({ variant: v.name, us, error });
          } catch (e) {
            console.error(`${typeName} ${shapeName(N, K)} t=${T} ${v.name}: ${String(e)}`);
            gpu.errors.length = 0;
            row.cells.push({ variant: v.name, us: null, error: Number.POSITIVE_INFINITY, note: 'error' });
          } finally {
            for (const dispatches of copies) releaseDispatches(gpu, dispatches);
          }
        }
        const line = formatRow(row, o.variants, o.matvec ? 'auto' : '32x32');
        lines.push(line);
        console.log(line);
        write();
        gpu.allocator.release(input);
        gpu.allocator.release(output);
      }
      for (const weight of weights) releaseWeight(gpu, weight);
      if (genS > 2)
        console.error(`(${typeName} ${shapeName(N, K)}: weights generated and uploaded in ${genS.toFixed(1)} s)`);
    }
  }
  const shapes = o.variants
    .map((v) => {
      if (o.matvec) return `${v.name}: ${v.about ?? `${v.name.slice(1)} threads`}`;
      if (v.variant === '32x32') return `${v.name}: 32×32, 2×2 per thread, K step 32, scalar reads`;
      const t = { ...MATMUL_TILES[v.variant], ...(v.name.endsWith('-noprefetch') ? { prefetch: false } : {}) };
      return (
        `${v.name}: ${t.rows}×${t.tokens}, ${t.rowsPerThread}×${t.tokensPerThread} per thread, K step ${t.k}` +
        `${t.prefetch ? ', register prefetch' : ''}`
      );
    })
    .join('; ');
  const footer = ['', `${o.matvec ? 'Workgroups of 4 rows' : 'Workgroup tiles (weight rows × tokens)'}: ${shapes}.`];
  console.log(footer.join('\n'));
  lines.push(...footer);
  write();
  gpu.destroy();
  releaseNodeGpu();
}

main().then(
  () => process.exit(0),
  (e) => {
    console.error(e instanceof Error ? (e.stack ?? e.message) : e);
    process.exit(1);
  },
);

/**
 * What WebGPU's arithmetic can reach on an adapter, for prefill's matmuls (BENCH.md): peak f32 multiply-adds (`fma`)
 * against 8-bit dot products (`dot4I8Packed`, WGSL's packed_4x8_integer_dot_product, 4 multiply-adds each), in
 * kernels of independent chains that touch memory once. No f16 arithmetic: `shader-f16` is absent on the adapters we
 * target. Prints JSON lines (and writes them with --out).
 *
 *   npx tsx bench/int8-dot-probe.ts [--out FILE.json]       # on the GPU host: .gpu/int8-dot-probe.mjs (bench:bundle)
 */
import { writeFileSync } from 'node:fs';
import { parseArgs } from 'node:util';
import { acquireGpu } from '../core/gpu/device.ts';
import { bindBuffers, computePipeline, type PreparedDispatch, uniformBuffer } from '../core/gpu/dispatch.ts';
import { nodeGpu } from '../core/gpu/node.ts';
import { readUint32 } from '../core/gpu/readback.ts';
import { timeDispatches } from './gpu-timing.ts';

const CHAINS = 8;
const UNROLL = 4;
const WG = 256;

/** A kernel of CHAINS independent chains, UNROLL steps each per loop iteration; `step(a)` is one chain's step. */
function probeSource(type: 'f32' | 'i32', init: (c: number) => string, step: (a: string) => string): string {
  const chains = Array.from({ length: CHAINS }, (_, c) => c);
  return /* wgsl */ `
@group(0) @binding(0) var<storage, read_write> out: array<u32>;
@group(0) @binding(1) var<uniform> params: vec4<u32>; // iterations, seed
@compute @workgroup_size(${WG})
fn main(@builtin(global_invocation_id) id: vec3<u32>, @builtin(num_workgroups) n: vec3<u32>) {
  let i = id.x + id.y * n.x * ${WG}u;
${chains.map((c) => `  var a${c}: ${type} = ${init(c)};`).join('\n')}
  for (var k = 0u; k < params.x; k++) {
${Array.from({ length: UNROLL }, () => chains.map((c) => `    a${c} = ${step(`a${c}`)};`).join('\n')).join('\n')}
  }
  out[i] = bitcast<u32>(${chains.map((c) => `a${c}`).join(' + ')});
}`;
}

const PROBES = [
  {
    name: 'f32 fma',
    macsPerStep: 1,
    code: probeSource(
      'f32',
      (c) => `f32(i + ${c}u) * 1e-7`,
      (a) => `fma(${a}, 0.999 + f32(params.y) * 1e-9, 1e-6)`,
    ),
  },
  {
    name: 'dot4I8Packed',
    macsPerStep: 4,
    code: probeSource(
      'i32',
      (c) => `i32(i + ${c}u)`,
      (a) => `${a} + dot4I8Packed(bitcast<u32>(${a}), params.y | 0x01010101u)`,
    ),
  },
];

/**
 * 8-bit subgroup matrices (Dawn's chromium_experimental_subgroup_matrix, i8 x i8 -> i32 at 16x16x32, as the int8
 * prefill kernels use them): CHAINS_MMA independent accumulators, UNROLL steps each per iteration; the right operand
 * held in registers (`registers`), or loaded before each product from a storage buffer or from workgroup memory,
 * within 16 KiB (the caches and the workgroup's tile). 8,192 multiply-adds per product and subgroup.
 */
const CHAINS_MMA = 4;
const MMA_WG = 128;
function matrixProbeSource(right: 'registers' | 'storage' | 'workgroup'): string {
  const chains = Array.from({ length: CHAINS_MMA }, (_, c) => c);
  const load = (from: string, offset: string) =>
    `subgroupMatrixLoad<subgroup_matrix_right<i8, 16, 32>, col_major>(&${from}, ${offset}, 8u)`;
  const step = (u: number) =>
    chains
      .map((c) => {
        const operand =
          right === 'registers'
            ? 'r0'
            : load(right === 'storage' ? 'src' : 'tile', `((k * ${UNROLL}u + ${u}u) * 136u + ${c * 512}u) % 3968u`);
        return `    c${c} = subgroupMatrixMultiplyAccumulate(l, ${operand}, c${c});`;
      })
      .join('\n');
  return /* wgsl */ `
enable chromium_experimental_subgroup_matrix;
enable subgroups;
diagnostic(off, chromium_experimental.subgroup_matrix_uniformity);
@group(0) @binding(0) var<storage, read> src: array<i32>;
@group(0) @binding(1) var<storage, read_write> dst: array<i32>;
@group(0) @binding(2) var<uniform> params: vec4<u32>; // iterations, seed
var<workgroup> tile: array<i32, 4096>;
@compute @workgroup_size(${MMA_WG})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(subgroup_id) sg: u32,
        @builtin(local_invocation_index) li: u32, @builtin(num_subgroups) subgroups: u32) {
  for (var i = li; i < 4096u; i += ${MMA_WG}u) { tile[i] = src[i]; }
  workgroupBarrier();
  let l = subgroupMatrixLoad<subgroup_matrix_left<i8, 32, 16>, row_major>(&src, sg * 128u, 8u);
  let r0 = ${load('src', '1024u + sg * 128u')};
${chains.map((c) => `  var c${c} = subgroup_matrix_result<i32, 16, 16>();`).join('\n')}
  for (var k = 0u; k < params.x; k++) {
${Array.from({ length: UNROLL }, (_, u) => step(u)).join('\n')}
  }
  let at = ((wg.x * subgroups + sg) * ${CHAINS_MMA}u) * 256u;
${chains.map((c) => `  subgroupMatrixStore<row_major>(&dst, at + ${c * 256}u, c${c}, 16u);`).join('\n')}
}`;
}

const { values } = parseArgs({ options: { out: { type: 'string' }, iterations: { type: 'string', default: '2048' } } });
const gpu = await acquireGpu({ gpu: await nodeGpu() });
console.log(JSON.stringify({ adapter: gpu.adapter }));
const iterations = Number(values.iterations);
// Enough workgroups to fill any GPU many times over (132 SMs on an H200).
const workgroups = gpu.adapter.isFallbackAdapter ? 16 : 4096;
const invocations = workgroups * WG;
const out = gpu.allocator.createStorage('probe.out', 'scratch', invocations * 4);
const params = uniformBuffer(gpu, 'probe.params', [iterations, 12345, 0, 0], 'uuuu');
const rows = [];
for (const probe of PROBES) {
  const pipeline = computePipeline(gpu, `probe ${probe.name}`, probe.code);
  const dispatch: PreparedDispatch = {
    label: probe.name,
    pipeline,
    bindGroup: bindBuffers(gpu, probe.name, pipeline, [out, params]),
    workgroups: [workgroups, 1, 1],
    owned: [],
  };
  const ms = await timeDispatches(gpu, [dispatch], gpu.adapter.isFallbackAdapter ? 1 : 10);
  const sample = await readUint32(gpu, out, 4);
  const macs = invocations * iterations * UNROLL * CHAINS * probe.macsPerStep;
  const row = {
    probe: probe.name,
    ms: Math.round(ms * 1000) / 1000,
    teraMacsPerS: Math.round(macs / (ms * 1e-3) / 1e10) / 100,
    sample: [...sample],
  };
  console.log(JSON.stringify(row));
  rows.push(row);
}
// One subgroup size, so the subgroups per workgroup (and the products counted, and dst's size) are known.
const { subgroupMinSize = 0, subgroupMaxSize = 0 } = gpu.adapter;
if (gpu.features.subgroupMatrixI8 && subgroupMinSize === subgroupMaxSize && subgroupMaxSize > 0) {
  const src = gpu.allocator.createStorage('probe.src', 'scratch', 4096 * 4);
  const words = new Int32Array(4096);
  for (let i = 0; i < words.length; i++) words[i] = (Math.imul(i + 1, 0x9e3779b1) >>> 0) & 0x3f3f3f3f;
  gpu.device.queue.writeBuffer(src, 0, words);
  const subgroups = workgroups * (MMA_WG / subgroupMaxSize);
  const dst = gpu.allocator.createStorage('probe.dst', 'scratch', subgroups * CHAINS_MMA * 256 * 4);
  const mmaIterations = Math.max(1, Math.floor(iterations / 8));
  const mmaParams = uniformBuffer(gpu, 'probe.mma.params', [mmaIterations, 12345, 0, 0], 'uuuu');
  for (const right of ['registers', 'storage', 'workgroup'] as const) {
    const name = `i8 subgroup matrix 16x16x32, right operand from ${right}`;
    const pipeline = computePipeline(gpu, `probe ${name}`, matrixProbeSource(right));
    const dispatch: PreparedDispatch = {
      label: name,
      pipeline,
      bindGroup: bindBuffers(gpu, name, pipeline, [src, dst, mmaParams]),
      workgroups: [workgroups, 1, 1],
      owned: [],
    };
    const ms = await timeDispatches(gpu, [dispatch], 10);
    const macs = subgroups * mmaIterations * UNROLL * CHAINS_MMA * 8192;
    const row = {
      probe: name,
      ms: Math.round(ms * 1000) / 1000,
      teraMacsPerS: Math.round(macs / (ms * 1e-3) / 1e10) / 100,
    };
    console.log(JSON.stringify(row));
    rows.push(row);
  }
}
if (values.out)
  writeFileSync(values.out, `${JSON.stringify({ adapter: gpu.adapter, iterations, workgroups, rows }, null, 1)}\n`);
gpu.destroy();
process.exit(0);

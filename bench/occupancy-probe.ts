/**
 * How many workgroups of a kernel an adapter keeps resident at once, by the kernel's workgroup memory, its size and
 * whether it uses subgroup matrices: each workgroup counts itself in on arrival and out when done (atomics), and the
 * most counted at once is the resident total (on an H200, 132 SMs times the workgroups each holds). The workgroups spin
 * long enough that the grid's first wave is all in flight. Prints JSON lines (and writes them with --out).
 *
 *   npx tsx bench/occupancy-probe.ts [--out FILE.json]      # on the GPU host: .gpu/occupancy-probe.mjs (bench:bundle)
 */
import { writeFileSync } from 'node:fs';
import { parseArgs } from 'node:util';
import { acquireGpu } from '../core/gpu/device.ts';
import { bindBuffers, computePipeline, uniformBuffer } from '../core/gpu/dispatch.ts';
import { nodeGpu } from '../core/gpu/node.ts';
import { readUint32 } from '../core/gpu/readback.ts';

interface ProbeShape {
  /** i32 words of workgroup memory. */
  words: number;
  workgroup: 128 | 256;
  /** The spin loop multiplies 8-bit subgroup matrices from that memory. */
  matrices: boolean;
}

function probeSource({ words, workgroup, matrices }: ProbeShape): string {
  return /* wgsl */ `
${matrices ? 'enable chromium_experimental_subgroup_matrix;\ndiagnostic(off, chromium_experimental.subgroup_matrix_uniformity);' : ''}
@group(0) @binding(0) var<storage, read_write> counters: array<atomic<u32>>;
@group(0) @binding(1) var<uniform> params: vec4<u32>; // iterations
var<workgroup> memory: array<i32, ${words}>;

@compute @workgroup_size(${workgroup})
fn main(@builtin(local_invocation_index) li: u32) {
  if (li == 0u) {
    let now = atomicAdd(&counters[0], 1u) + 1u;
    atomicMax(&counters[1], now);
  }
  var x = li * 2654435761u + 1u;
  for (var i = 0u; i < params.x; i++) {
    memory[(x + i) % ${words}u] = i32(x);
    x = x * 1664525u + 1013904223u + u32(memory[(x ^ i) % ${words}u]);
${
  matrices
    ? `    let left = subgroupMatrixLoad<subgroup_matrix_left<i8, 32, 16>, row_major>(&memory, (i * 136u) % ${words - 256}u, 8u);
    let right = subgroupMatrixLoad<subgroup_matrix_right<i8, 16, 32>, col_major>(&memory, (i * 72u) % ${words - 256}u, 8u);
    subgroupMatrixStore<row_major>(&memory, (i * 264u) % ${words - 256}u, subgroupMatrixMultiply<i32>(left, right), 16u);`
    : ''
}
    workgroupBarrier();
  }
  if (li == 0u) {
    atomicSub(&counters[0], 1u);
    atomicAdd(&counters[2], x & 1u);
  }
}`;
}

const { values } = parseArgs({ options: { out: { type: 'string' } } });
const gpu = await acquireGpu({ gpu: await nodeGpu() });
console.log(JSON.stringify({ adapter: gpu.adapter }));
const counters = gpu.allocator.createStorage('probe.counters', 'scratch', 16);
const params = uniformBuffer(gpu, 'probe.params', [20000, 0, 0, 0], 'uuuu');
const rows: Record<string, unknown>[] = [];
const kib = [4, 16, 20, 24, 32, 42.5, 48];
for (const matrices of gpu.features.subgroupMatrixI8 ? [false, true] : [false]) {
  for (const workgroup of [128, 256] as const) {
    for (const size of kib) {
      const words = Math.min(Math.floor((size * 1024) / 4), gpu.limits.maxComputeWorkgroupStorageSize / 4);
      const pipeline = computePipeline(
        gpu,
        `probe-${words}-${workgroup}-${matrices}`,
        probeSource({ words, workgroup, matrices }),
      );
      const bindGroup = bindBuffers(gpu, 'probe', pipeline, [counters, params]);
      gpu.device.queue.writeBuffer(counters, 0, new Uint32Array(4));
      const encoder = gpu.device.createCommandEncoder();
      const pass = encoder.beginComputePass();
      pass.setPipeline(pipeline);
      pass.setBindGroup(0, bindGroup);
      pass.dispatchWorkgroups(2048);
      pass.end();
      gpu.device.queue.submit([encoder.finish()]);
      const [running, resident] = await readUint32(gpu, counters, 2);
      const row = { workgroupBytes: words * 4, workgroup, matrices, resident, leftRunning: running };
      console.log(JSON.stringify(row));
      rows.push(row);
    }
  }
}
gpu.throwIfErrors();
if (values.out) writeFileSync(values.out, `${JSON.stringify({ adapter: gpu.adapter, rows }, null, 1)}\n`);
gpu.destroy();
process.exit(0);

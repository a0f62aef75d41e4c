/**
 * How fast Dawn moves KV pages between host memory and the GPU on this machine: `queue.writeBuffer` per page (in
 * decreasing and increasing page order), in one call and in chunks, through staging buffers mapped at creation, and
 * reads back through `mapAsync` staging with one to eight buffers in flight; then the host's own memcpy, SHA-256 per
 * page (WebCrypto and node:crypto) and a file read of the same bytes. The floor under a resumed conversation's copy-in
 * (bench/kv-resume.ts). Prints JSON lines.
 *
 *   npx tsx bench/transfer-probe.ts [MiB] [pageBytes]     # on the GPU host: .gpu/transfer-probe.mjs (bench:bundle)
 */
import { createHash } from 'node:crypto';
import { readFile, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { nodeGpu } from '../core/gpu/node.ts';

const MiB = 2 ** 20;

async function main(): Promise<void> {
  const gpu = await nodeGpu();
  const adapter = await gpu.requestAdapter();
  if (!adapter) throw new Error('no adapter');
  const device = await adapter.requestDevice({
    requiredLimits: {
      maxBufferSize: adapter.limits.maxBufferSize,
      maxStorageBufferBindingSize: adapter.limits.maxStorageBufferBindingSize,
    },
  });
  const pageBytes = Number(process.argv[3] ?? 75776);
  const pages = Math.floor((Number(process.argv[2] ?? 189) * MiB) / pageBytes);
  const bytes = pages * pageBytes;
  const slab = device.createBuffer({
    size: bytes,
    usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_DST | GPUBufferUsage.COPY_SRC,
  });
  const data = new Uint8Array(bytes);
  for (let i = 0; i < bytes; i += 4096) data[i] = i & 255;
  const done = () => device.queue.onSubmittedWorkDone();

  async function time(name: string, run: () => unknown, repeats = 3): Promise<void> {
    const all: Array<{ hostMs: number; totalMs: number }> = [];
    for (let r = 0; r < repeats; r++) {
      await done();
      const t0 = performance.now();
      await run();
      const t1 = performance.now();
      await done();
      all.push({ hostMs: +(t1 - t0).toFixed(2), totalMs: +(performance.now() - t0).toFixed(2) });
    }
    const bestMs = Math.min(...all.map((a) => a.totalMs));
    const MB = +(bytes / MiB).toFixed(1);
    console.log(JSON.stringify({ name, MB, pages, pageBytes, bestMs, GBps: +(bytes / 1e6 / bestMs).toFixed(2), all }));
  }

  const write = (at: number, size: number) => device.queue.writeBuffer(slab, at, data.buffer, at, size);
  await time('writeBuffer per page, reverse order', () => {
    for (let p = pages - 1; p >= 0; p--) write(p * pageBytes, pageBytes);
    device.queue.submit([]);
  });
  await time('writeBuffer per page, increasing', () => {
    for (let p = 0; p < pages; p++) write(p * pageBytes, pageBytes);
    device.queue.submit([]);
  });
  await time('writeBuffer one call', () => {
    write(0, bytes);
    device.queue.submit([]);
  });
  for (const chunkMiB of [8, 32]) {
    const chunk = chunkMiB * MiB;
    await time(`writeBuffer ${chunkMiB} MiB chunks`, () => {
      for (let at = 0; at < bytes; at += chunk) write(at, Math.min(chunk, bytes - at));
      device.queue.submit([]);
    });
  }
  for (const chunkMiB of [8, 32]) {
    const chunk = chunkMiB * MiB;
    await time(`mappedAtCreation staging ${chunkMiB} MiB + copy per page`, () => {
      const encoder = device.createCommandEncoder();
      for (let at = 0; at < bytes; at += chunk) {
        const size = Math.min(chunk, bytes - at);
        const staging = device.createBuffer({ size, usage: GPUBufferUsage.COPY_SRC, mappedAtCreation: true });
        new Uint8Array(staging.getMappedRange()).set(data.subarray(at, at + size));
        staging.unmap();
        for (let a = 0; a < size; a += pageBytes) {
          encoder.copyBufferToBuffer(staging, a, slab, at + a, Math.min(pageBytes, size - a));
        }
      }
      device.queue.submit([encoder.finish()]);
    });
  }
  for (const [chunkMiB, inFlight] of [
    [32, 1],
    [32, 4],
    [8, 8],
    [64, 2],
  ]) {
    const chunk = chunkMiB * MiB;
    await time(`readback ${chunkMiB} MiB staging, ${inFlight} in flight, copy per page`, async () => {
      const out = new Uint8Array(bytes);
      let next = 0;
      const reader = async () => {
        for (let at = next * chunk; at < bytes; at = ++next * chunk) {
          const size = Math.min(chunk, bytes - at);
          const staging = device.createBuffer({ size, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST });
          const encoder = device.createCommandEncoder();
          for (let a = 0; a < size; a += pageBytes) {
            encoder.copyBufferToBuffer(slab, at + a, staging, a, Math.min(pageBytes, size - a));
          }
          device.queue.submit([encoder.finish()]);
          await staging.mapAsync(GPUMapMode.READ);
          out.set(new Uint8Array(staging.getMappedRange()), at);
          staging.unmap();
          staging.destroy();
        }
      };
      await Promise.all(Array.from({ length: inFlight }, reader));
    });
  }
  await time('host memcpy of the bytes', () => new Uint8Array(bytes).set(data));
  const page = (p: number) => data.subarray(p * pageBytes, (p + 1) * pageBytes);
  await time('sha256 per page (crypto.subtle, all at once)', () =>
    Promise.all(Array.from({ length: pages }, (_, p) => crypto.subtle.digest('SHA-256', page(p)))),
  );
  await time('sha256 per page (node:crypto sync)', () => {
    for (let p = 0; p < pages; p++) createHash('sha256').update(page(p)).digest();
  });
  const file = join(tmpdir(), 'longtab-transfer-probe.bin');
  await writeFile(file, data);
  await time('fs.readFile of the bytes (page cache)', () => readFile(file));
  device.destroy();
}

await main();

import { execFile } from 'node:child_process';
import { mkdtempSync, readFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import { getLlama } from 'node-llama-cpp';
import { describe, expect, it } from 'vitest';
import { LongtabError } from '../../core/errors.ts';
import { acquireGpu } from '../../core/gpu/device.ts';
import { nodeGpu } from '../../core/gpu/node.ts';
import { STORIES260K, STORIES260K_GOLDEN, sharedPath } from '../../test/shared.ts';
import { ModelRunner } from '../engine/model-runner.ts';
import { sourceFromPath } from '../gguf/node-source.ts';
import { parseGguf } from '../gguf/parse.ts';
import { readModelConfig } from '../model/config.ts';
import { nodeRotationCache } from './rotation-cache-node.ts';
import { decodeRotations, encodeRotations, modelDigest, rotationsFromMetadata } from './rotation-store.ts';

const run = promisify(execFile);
const bin = join(dirname(fileURLToPath(import.meta.url)), '..', '..', 'bin', 'longtab.mjs');
const modelPath = sharedPath(STORIES260K);
const goldenPath = sharedPath(STORIES260K_GOLDEN);

describe.skipIf(!modelPath || !goldenPath)('calibrated rotations at rest (stories260K)', () => {
  it('longtab calibrate caches them by digest and embeds them in a copy llama.cpp still runs', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'longtab-calibrate-'));
    const embedded = join(dir, 'stories-rotated.gguf');
    const env = { ...process.env, LONGTAB_CACHE_DIR: dir, XDG_RUNTIME_DIR: '/tmp' };
    const { stdout } = await run(
      process.execPath,
      [bin, 'calibrate', '--model', modelPath!, '--tokens', '96', '--out', join(dir, 'r.bin'), '--embed', embedded],
      { env },
    );
    const report = JSON.parse(stdout.trim().split('\n').pop()!);

    const original = await sourceFromPath(modelPath!);
    const originalFile = await parseGguf(original);
    const config = readModelConfig(originalFile);
    expect(report.digest).toBe(await modelDigest(originalFile, original));

    const copy = await sourceFromPath(embedded);
    const copyFile = await parseGguf(copy);
    // The digest ignores longtab's own keys: the copy is the same model and finds the same cache entry.
    expect(await modelDigest(copyFile, copy)).toBe(report.digest);
    const fromMetadata = rotationsFromMetadata(copyFile.metadata, config)!;
    const cached = decodeRotations((await nodeRotationCache(dir).get(report.digest))!, config);
    expect(fromMetadata.tokens).toBe(96);
    expect(Array.from(fromMetadata.key)).toEqual(Array.from(cached.key));
    expect(Array.from(fromMetadata.value)).toEqual(Array.from(cached.value));
    expect(rotationsFromMetadata(originalFile.metadata, config)).toBeNull();
    await original.close?.();
    await copy.close?.();

    // Tensor data was copied intact: greedy output of the copy is still the golden one, in llama.cpp too.
    const golden = JSON.parse(readFileSync(goldenPath!, 'utf8')) as { greedy_ids: number[] };
    const llama = await getLlama({ gpu: false, build: 'never' });
    const model = await llama.loadModel({ modelPath: embedded });
    const context = await model.createContext({ contextSize: 128, threads: 1 });
    const ids: number[] = [];
    for await (const token of context.getSequence().evaluate([golden.greedy_ids[0]] as never, { temperature: 0 })) {
      ids.push(token as number);
      if (ids.length === 16) break;
    }
    expect(ids).toEqual(golden.greedy_ids.slice(1, 17));
    await context.dispose();
    await model.dispose();

    // longtab loads the rotations for rotation: 'calibrated' from the file itself, or from the cache by digest.
    const gpu = await acquireGpu({ gpu: await nodeGpu() });
    try {
      const engine = new ModelRunner(gpu);
      const kv = { kv: 'int2' as const, rotation: 'calibrated' as const, sink: 16, window: 16 };
      await engine.load(await sourceFromPath(embedded), kv);
      expect(engine.loaded!.kv.rotation.kind).toBe('calibrated');
      const fromFile = await engine.generate({ promptIds: [1], maxTokens: 40, stopAtEog: false });
      await engine.load(await sourceFromPath(modelPath!), { ...kv, rotationCache: nodeRotationCache(dir) });
      const fromCache = await engine.generate({ promptIds: [1], maxTokens: 40, stopAtEog: false });
      expect(fromCache.ids).toEqual(fromFile.ids);
      await expect(engine.load(await sourceFromPath(modelPath!), kv)).rejects.toThrow(/longtab calibrate/);
      engine.unload();
    } finally {
      gpu.destroy();
    }
  });

  it('damaged or mismatched cached rotations are a typed error', async () => {
    const source = await sourceFromPath(modelPath!);
    const config = readModelConfig(await parseGguf(source));
    await source.close?.();
    const n = config.layers * config.kvHeads * config.headDim ** 2;
    const good = encodeRotations({
      key: new Float32Array(n).fill(0.5),
      value: new Float32Array(n).fill(-0.25),
      tokens: 7,
    });
    expect(decodeRotations(good, config).tokens).toBe(7);
    expect(() => decodeRotations(good.subarray(0, good.length - 4), config)).toThrow(LongtabError);
    expect(() =>
      decodeRotations(encodeRotations({ key: new Float32Array(8), value: new Float32Array(8), tokens: 1 }), config),
    ).toThrow(/another model shape/);
  });
});

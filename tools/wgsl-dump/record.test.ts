/**
 * The dump cannot drift from the runtime: for the demo model in both KV modes, what recordPipelines records (and
 * writeDump writes) is exactly what an engine compiles when it loads the model and generates from a prompt of one
 * full prefill chunk, label for label and byte for byte, less the promotion only a rollback compiles.
 */
import { createHash } from 'node:crypto';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { type KvMode, ModelRunner } from '../../runtime/engine/model-runner.ts';
import { sourceFromPath } from '../../runtime/gguf/node-source.ts';
import { withTestGpu } from '../../test/gpu.ts';
import { type CompiledPipeline, withShaderHooks } from '../../test/shader-hooks.ts';
import { DEMO_MODEL, recordPipelines } from './record.ts';
import { dumpIndex, foldLayers, writeDump } from './write.ts';

const ctx = withTestGpu();

/** A pipeline as "label entry sha256-of-code", so a difference names the kernel. */
const key = (p: Pick<CompiledPipeline, 'label' | 'entryPoint' | 'code'>) =>
  `${p.label} ${p.entryPoint} ${createHash('sha256').update(p.code).digest('hex').slice(0, 16)}`;

describe.each<KvMode>(['f16', 'int2'])('wgsl dump of the demo model, kv %s', (kv) => {
  it('holds exactly the pipelines an engine compiles to load and generate', async () => {
    const { gpu } = ctx;
    const source = await sourceFromPath(DEMO_MODEL);
    try {
      const dump = await recordPipelines(gpu, source, { model: 'demo', kv });

      const compiled: CompiledPipeline[] = [];
      const engine = new ModelRunner(withShaderHooks(gpu, { pipeline: (_, made) => compiled.push(made) }));
      await engine.load(source, { kv });
      const chunk = engine.loaded!.transformer.maxTokens;
      const vocab = engine.config.vocab;
      const promptIds = Array.from({ length: chunk }, (_, i) => 1 + ((i * 7) % (vocab - 1)));
      const reply = await engine.generate({ promptIds, maxTokens: 3, stopAtEog: false });
      engine.unload();
      expect(reply.ids).toHaveLength(3);

      expect(dump.prefillChunk).toBe(chunk);
      const recorded = dump.pipelines.filter((p) => p.phase !== 'rollback');
      expect(recorded.map(key).sort()).toEqual([...new Set(compiled.map(key))].sort());
      expect(dump.pipelines.filter((p) => p.phase === 'rollback').map((p) => p.label)).toEqual(
        kv === 'int2' ? ['kv-promote'] : [],
      );
      const labels = dump.pipelines.map((p) => p.label);
      for (const label of ['embedding', 'rmsnorm', 'rope', 'kv-append', 'matvec', 'sample.draw']) {
        expect(labels).toContain(label);
      }
      if (kv === 'int2') expect(labels).toContain('kv-demote');
      // Every dispatched pipeline names its dispatches (probes are compiled, never dispatched).
      for (const p of dump.pipelines) if (p.label !== 'probe') expect(p.dispatches, p.label).not.toEqual([]);

      const dir = mkdtempSync(join(tmpdir(), 'wgsl-dump-'));
      try {
        const files = writeDump(dump, dir);
        const index = dumpIndex(dump);
        expect(files).toEqual([...index.map((e) => e.file), 'index.md', 'index.json']);
        expect(new Set(files).size).toBe(files.length);
        dump.pipelines.forEach((p, i) => {
          expect(readFileSync(join(dir, index[i].file), 'utf8')).toBe(p.code);
        });
        const written = JSON.parse(readFileSync(join(dir, 'index.json'), 'utf8'));
        expect(written.pipelines.map((e: { label: string }) => e.label)).toEqual(labels);
      } finally {
        rmSync(dir, { recursive: true, force: true });
      }
    } finally {
      await source.close?.();
    }
  });
});

describe('the dump index', () => {
  it('folds layer numbers into ranges', () => {
    const labels = [0, 1, 2, 3, 5, 7, 8].map((l) => `blk.${l}.down`);
    const parts = ['output#0', 'output#1', 'output#2', 'blk.0.q#0', 'blk.0.q#1', 'blk.1.q#0', 'blk.1.q#1'];
    expect(foldLayers([...labels, 'kv.promote.layer0', 'kv.promote.layer1', 'blk.4.rope', ...parts])).toEqual([
      'blk.{0-3,5,7-8}.down',
      'kv.promote.layer{0-1}',
      'blk.4.rope',
      'output#{0-2}',
      'blk.{0-1}.q#{0-1}',
    ]);
  });
});

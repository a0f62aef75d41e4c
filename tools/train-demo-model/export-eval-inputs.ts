/**
 * Writes what `emulate_kv.py` needs to replay the runtime's evaluations on the CPU, from the runtime's own code:
 *   - `<out>.trials.json`: retrieval trials exactly as `longtab eval --task copy|passkey|recall` builds them (same
 *     builder, seed 1, the same trial indices), ids and scored positions;
 *   - `<out>.rotations.json` + `<out>.key.f32` / `<out>.value.f32`: the calibrated rotations and clip quantiles
 *     embedded in the GGUF ([layers × kvHeads × headDim × headDim] f32, applied as x·R).
 *
 *   npx tsx tools/train-demo-model/export-eval-inputs.ts MODEL.gguf FILLER.txt OUT_PREFIX [task] [length] [depth] [trials]
 *
 * Loads the model on the GPU (Dawn) for its tokenizer only; nothing is scored here.
 */
import { readFileSync, writeFileSync } from 'node:fs';
import { Engine } from '../../runtime/engine/engine.ts';
import { RETRIEVAL_TASKS, type RetrievalTask, RetrievalTaskBuilder } from '../../runtime/eval/retrieval.ts';
import { sourceFromPath } from '../../runtime/gguf/node-source.ts';
import { acquireGpu } from '../../runtime/gpu/device.ts';
import { nodeGpu, releaseNodeGpu } from '../../runtime/gpu/node.ts';
import { rotationsFromMetadata } from '../../runtime/kv/rotation-store.ts';

const [model, fillerPath, out, task = 'copy', length = '2048', depth = '1536', count = '40'] = process.argv.slice(2);
if (!model || !fillerPath || !out || !RETRIEVAL_TASKS.includes(task as RetrievalTask)) {
  console.error(
    'usage: export-eval-inputs.ts MODEL.gguf FILLER.txt OUT_PREFIX [copy|passkey|recall] [length] [depth] [trials]',
  );
  process.exit(2);
}
const gpu = await acquireGpu({ gpu: await nodeGpu() });
const engine = new Engine(gpu);
const source = await sourceFromPath(model);
try {
  const config = await engine.load(source, { kv: 'f16' });
  const filler = engine.tokenizer.encode(readFileSync(fillerPath, 'utf8'), { addSpecial: false });
  // The CLI's builder with the CLI's default settings and seed (runtime/cli/eval.ts runRetrievalEval).
  const builder = new RetrievalTaskBuilder(engine.tokenizer, filler, {}, 1);
  const trials = Array.from({ length: Number(count) }, (_, i) => {
    const t = builder.trial(task as RetrievalTask, Number(length), Number(depth), i);
    return { ids: t.ids, items: t.items, baselineItems: t.baselineItems ?? null };
  });
  writeFileSync(
    `${out}.trials.json`,
    JSON.stringify({ model, filler: fillerPath, task, length: Number(length), depth: Number(depth), trials }),
  );
  const rotations = rotationsFromMetadata(engine.loaded!.file.metadata, config);
  if (rotations) {
    const { layers, kvHeads, headDim } = config;
    for (const kind of ['key', 'value'] as const) writeFileSync(`${out}.${kind}.f32`, rotations[kind]);
    writeFileSync(`${out}.rotations.json`, JSON.stringify({ layers, kvHeads, headDim, clip: rotations.clip ?? null }));
  }
  console.log(
    `${out}.trials.json: ${trials.length} ${task} trials${rotations ? '; rotations written' : '; no embedded rotations'}`,
  );
} finally {
  engine.unload();
  await source.close?.();
  gpu.destroy();
  releaseNodeGpu();
}

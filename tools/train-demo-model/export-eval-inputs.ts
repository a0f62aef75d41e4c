/**
 * Writes what `emulate_kv.py` needs to replay the runtime's evaluations on the CPU, from the runtime's own code:
 *   - `<out>.trials.json`: retrieval trials exactly as `longtab eval --task copy|passkey|recall` builds them (same
 *     builder, seed 1, the same trial indices), ids and scored positions;
 *   - `<out>.rotations.json` + `<out>.key.f32` / `<out>.value.f32`: the calibrated rotations and clip quantiles
 *     embedded in the GGUF ([layers × kvHeads × headDim × headDim] f32, applied as x·R).
 *
 *   npx tsx tools/train-demo-model/export-eval-inputs.ts MODEL.gguf FILLER.txt OUT_PREFIX [task] [length] [depth] [trials]
 *
 * Reads only the GGUF's metadata (tokenizer, rotations); nothing touches the GPU and nothing is scored here.
 */
import { readFileSync, writeFileSync } from 'node:fs';
import {
  DEFAULT_RETRIEVAL_SEED,
  RETRIEVAL_TASKS,
  type RetrievalTask,
  RetrievalTaskBuilder,
} from '../../runtime/eval/retrieval.ts';
import { sourceFromPath } from '../../runtime/gguf/node-source.ts';
import { parseGguf } from '../../runtime/gguf/parse.ts';
import { rotationsFromMetadata } from '../../runtime/kv/rotation-store.ts';
import { readModelConfig } from '../../runtime/model/config.ts';
import { GgufTokenizer } from '../../runtime/tokenizer/tokenizer.ts';

const [model, fillerPath, out, task = 'copy', length = '2048', depth = '1536', count = '40'] = process.argv.slice(2);
if (!model || !fillerPath || !out || !RETRIEVAL_TASKS.includes(task as RetrievalTask)) {
  console.error(
    'usage: export-eval-inputs.ts MODEL.gguf FILLER.txt OUT_PREFIX [copy|passkey|recall] [length] [depth] [trials]',
  );
  process.exit(2);
}
const source = await sourceFromPath(model);
try {
  const file = await parseGguf(source);
  const config = readModelConfig(file);
  const tokenizer = GgufTokenizer.fromMetadata(file.metadata);
  const filler = tokenizer.encode(readFileSync(fillerPath, 'utf8'), { addSpecial: false });
  // The CLI's builder with the CLI's default settings and seed (runtime/cli/eval.ts runRetrievalEval).
  const builder = new RetrievalTaskBuilder(tokenizer, filler, {}, DEFAULT_RETRIEVAL_SEED);
  const trials = Array.from({ length: Number(count) }, (_, i) => {
    const t = builder.trial(task as RetrievalTask, Number(length), Number(depth), i);
    return { ids: t.ids, items: t.items, baselineItems: t.baselineItems ?? null };
  });
  writeFileSync(
    `${out}.trials.json`,
    JSON.stringify({ model, filler: fillerPath, task, length: Number(length), depth: Number(depth), trials }),
  );
  const rotations = rotationsFromMetadata(file.metadata, config);
  if (rotations) {
    const { layers, kvHeads, headDim } = config;
    for (const kind of ['key', 'value'] as const) writeFileSync(`${out}.${kind}.f32`, rotations[kind]);
    writeFileSync(`${out}.rotations.json`, JSON.stringify({ layers, kvHeads, headDim, clip: rotations.clip ?? null }));
  }
  console.log(
    `${out}.trials.json: ${trials.length} ${task} trials${rotations ? '; rotations written' : '; no embedded rotations'}`,
  );
} finally {
  await source.close?.();
}

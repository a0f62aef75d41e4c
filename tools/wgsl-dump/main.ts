/**
 * `npm run wgsl:dump -- --model SHAPE --kv f16|int2 [--mix q4_k_m|q4_0] [--prefill-chunk N] [--kv-budget-mib N]
 *                       [--out DIR]`
 *
 * Writes every compute pipeline the runtime compiles for a model, with its label, into DIR (default
 * `.wgsl-dump/<model>-<kv>/`): one .wgsl file per pipeline and an index (tools/wgsl-dump/write.ts). SHAPE is `demo`
 * (public/models/longtab-demo.gguf), `stories260K` (shared folder), a bench shape (bench/models.ts: quick-tiny,
 * qwen2.5-0.5b, llama-3.2-1b, qwen3-4b; loaded with zero matrices, nothing written to disk) or a .gguf path. The
 * pipelines are compiled for real on this machine's device (Dawn), and which kernels the runtime picks depends on it.
 * Load options are the engine's defaults; on a device with tensor cores the KV budget bounds the prefill chunk
 * (defaultPrefillChunk): give the bench's with --kv-budget-mib to see its 1024-token graphs.
 * On a 2-core machine with lavapipe: 2-3 s for the demo model, 8 s (qwen2.5-0.5b) to 34 s (qwen3-4b, 3 GB of memory)
 * with Mesa's shader cache warm; the first compile of a shape's kernels takes 1-6 minutes more.
 */
import { join } from 'node:path';
import { parseArgs } from 'node:util';
import { WEIGHT_MIXES, type WeightMix } from '../../bench/models.ts';
import { acquireGpu } from '../../core/gpu/device.ts';
import { nodeGpu, releaseNodeGpu } from '../../core/gpu/node.ts';
import type { KvMode } from '../../runtime/engine/model-runner.ts';
import { MODEL_NAMES, modelSource, recordPipelines } from './record.ts';
import { writeDump } from './write.ts';

const USAGE = `npm run wgsl:dump -- --model SHAPE --kv f16|int2 [--mix ${WEIGHT_MIXES.join('|')}] [--prefill-chunk N]
  [--kv-budget-mib N] [--out DIR]
  SHAPE: ${MODEL_NAMES.join(', ')}, or a .gguf path`;

const { values } = parseArgs({
  options: {
    model: { type: 'string' },
    kv: { type: 'string', default: 'f16' },
    mix: { type: 'string', default: 'q4_k_m' },
    'prefill-chunk': { type: 'string' },
    'kv-budget-mib': { type: 'string' },
    out: { type: 'string' },
    help: { type: 'boolean', short: 'h' },
  },
});
if (values.help || !values.model) {
  console.log(USAGE);
  process.exit(values.help ? 0 : 2);
}
const kv = values.kv as KvMode;
const mix = values.mix as WeightMix;
if (kv !== 'f16' && kv !== 'int2') throw new Error(`--kv ${values.kv}: use f16 or int2\n${USAGE}`);
if (!WEIGHT_MIXES.includes(mix)) throw new Error(`--mix ${values.mix}: use ${WEIGHT_MIXES.join(' or ')}`);
const prefillChunk = values['prefill-chunk'] === undefined ? undefined : Number(values['prefill-chunk']);
const budgetMib = values['kv-budget-mib'];
const kvBudgetBytes = budgetMib === undefined ? undefined : Math.round(Number(budgetMib) * 2 ** 20);

const model = values.model;
const name = model.endsWith('.gguf') ? model.replace(/^.*\//, '').replace(/\.gguf$/, '') : model;
const out = values.out ?? join('.wgsl-dump', `${name}-${kv}`);
const gpu = await acquireGpu({ gpu: await nodeGpu() });
const source = await modelSource(model, mix);
try {
  const record = await recordPipelines(gpu, source, { model: name, kv, prefillChunk, kvBudgetBytes });
  const files = writeDump(record, out);
  console.log(
    `${record.pipelines.length} pipelines (prefill chunk ${record.prefillChunk}) in ${record.seconds.toFixed(1)} s ` +
      `on ${gpu.adapter.description || gpu.adapter.vendor}: ${files.length} files in ${out}/ (index.md)`,
  );
} finally {
  await source.close?.();
  gpu.destroy();
  releaseNodeGpu();
}

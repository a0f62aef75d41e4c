import { InvalidRequestError } from '../../core/errors.ts';
import type { ByteSource, GgufFile } from '../../core/gguf-types.ts';
import type { GpuContext } from '../../core/gpu/device.ts';
import { calibrateKvRotations } from '../calibration/calibrate.ts';
import { ModelRunner } from '../engine/model-runner.ts';
import {
  accumulateLayerFidelity,
  type CalibratedKv,
  DEFAULT_QUANT_POLICY,
  emptySums,
  FIDELITY_MODES,
  type FidelitySums,
  type FidelityVariant,
  fidelityMarkdown,
  fidelityVariant,
  firstQuantizedQuery,
  type QuantPolicy,
  summarize,
} from '../eval/fidelity.ts';
import { captureAttentionInputs } from '../eval/fidelity-capture.ts';
import { readTextFromPath, sourceFromPath } from '../gguf/node-source.ts';
import { defaultGroupSize } from '../kv/quant-format.ts';
import { nodeRotationCache } from '../kv/rotation-cache-node.ts';
import { findStoredRotations } from '../kv/rotation-store.ts';
import type { ModelConfig } from '../model/config.ts';
import { numberFlag, type ParsedArgs, stringFlag } from './args.ts';
import { defaultModelPath } from './default-model.ts';

/** Most tokens the calibrated rotations are fitted on when the model has none stored (held out from the windows). */
const CALIBRATION_TOKENS = 2048;

/**
 * `longtab fidelity --model FILE --text FILE --ctx N [--windows W] [--modes a,b] [--sink S --window W
 * --group-size G] [--json]`: per layer, how far each quantized KV cache moves the attention outputs and weights
 * from the f16 cache's on the model's own activations over real text (runtime/eval/fidelity.ts).
 */
export async function runFidelity(args: ParsedArgs, gpu: GpuContext): Promise<number> {
  const modelPath = stringFlag(args, 'model') ?? defaultModelPath();
  const textPath = stringFlag(args, 'text') ?? args.positional[0];
  if (!textPath) throw new InvalidRequestError('Usage: longtab fidelity --model FILE --text FILE --ctx N');
  const text = readTextFromPath(textPath, 'the text file');
  const windows = numberFlag(args, 'windows', 1);
  const modes = (stringFlag(args, 'modes') ?? FIDELITY_MODES.join(',')).split(',').filter(Boolean);
  const policy: QuantPolicy = {
    ...DEFAULT_QUANT_POLICY,
    sink: numberFlag(args, 'sink', DEFAULT_QUANT_POLICY.sink),
    window: numberFlag(args, 'window', DEFAULT_QUANT_POLICY.window),
  };
  const groupSize = args.flags.has('group-size') ? numberFlag(args, 'group-size', 128) : undefined;
  for (const [name, value] of [
    ['windows', windows],
    ['sink', policy.sink],
    ['window', policy.window],
  ] as const) {
    if (!Number.isInteger(value) || value < (name === 'windows' ? 1 : 0))
      throw new InvalidRequestError(`--${name} must be a non-negative integer${name === 'windows' ? ' >= 1' : ''}.`);
  }
  const engine = new ModelRunner(gpu);
  const source = await sourceFromPath(modelPath);
  const log = (line: string) => process.stderr.write(`${line}\n`);
  try {
    await engine.load(source, { kv: 'f16' });
    const { config } = engine;
    const ctx = numberFlag(args, 'ctx', config.contextLength);
    const firstQuery = firstQuantizedQuery(policy);
    if (!Number.isInteger(ctx) || ctx <= firstQuery)
      throw new InvalidRequestError(
        `--ctx ${ctx}: no query would read a quantized page; it must exceed sink pages + one page + window = ${firstQuery}.`,
      );
    const ids = engine.tokenizer.encode(text, { addSpecial: false });
    const available = Math.floor(ids.length / ctx);
    if (available < windows)
      throw new InvalidRequestError(`${textPath} holds ${ids.length} tokens: ${available} windows of ${ctx}.`);
    const weights = engine.loaded!.weights;
    let calibration: { source: string; tokens: number; clip: CalibratedKv['clip'] | null } | null = null;
    let calibrated: CalibratedKv | null = null;
    if (modes.includes('int2-calibrated')) {
      const found = await storedRotations(engine.loaded!.file, source, config);
      if (found) {
        calibrated = found.rotations;
        calibration = { source: found.source, tokens: found.tokens, clip: calibrated.clip ?? null };
      } else {
        // One sequence no longer than the windows, so the fit sees the positions the model was evaluated at.
        const heldOut = ids.slice(windows * ctx, windows * ctx + Math.min(CALIBRATION_TOKENS, ctx));
        if (heldOut.length < 256)
          throw new InvalidRequestError(
            'int2-calibrated: the model has no stored rotations and the text leaves fewer than 256 tokens after the windows to fit them on.',
          );
        log(`fitting calibrated rotations on ${heldOut.length} held-out tokens (text after the windows)`);
        // The clip quantiles are fitted for the row format evaluated here, as `longtab calibrate` does for the default.
        const fitted = await calibrateKvRotations(gpu, config, weights, heldOut, { clip: { groupSize } });
        calibrated = {
          key: fitted.key,
          value: fitted.value,
          ...(fitted.clip ? { clip: { key: fitted.clip.key, value: fitted.clip.value } } : {}),
        };
        calibration = {
          source: `fitted here on tokens ${windows * ctx}..${windows * ctx + heldOut.length - 1} of the text (after the windows)`,
          tokens: heldOut.length,
          clip: calibrated.clip ?? null,
        };
      }
    }
    const shape = { layers: config.layers, heads: config.heads, kvHeads: config.kvHeads, headDim: config.headDim };
    const variants: FidelityVariant[] = modes.map((m) => fidelityVariant(m, shape, { groupSize, calibrated }));
    const sums: FidelitySums[][] = Array.from({ length: config.layers }, () => variants.map(() => emptySums()));
    const started = performance.now();
    for (let w = 0; w < windows; w++) {
      const window = ids.slice(w * ctx, (w + 1) * ctx);
      const captured = await captureAttentionInputs(gpu, config, weights, window, {
        chunk: numberFlag(args, 'chunk', 128),
      });
      for (let l = 0; l < config.layers; l++) {
        accumulateLayerFidelity(l, captured[l], ctx, shape, policy, variants, sums[l], firstQuery);
        log(`window ${w + 1}/${windows}, layer ${l + 1}/${config.layers}`);
      }
    }
    const summary = summarize(variants, sums);
    const names = variants.map((v) => v.name);
    const report = {
      command: [
        'longtab fidelity',
        ...args.positional,
        ...[...args.flags].map(([k, v]) => (v === true ? `--${k}` : `--${k} ${v}`)),
      ].join(' '),
      model: modelPath,
      text: textPath,
      ctx,
      windows,
      tokens: windows * ctx,
      adapter: gpu.adapter,
      cache: {
        ...policy,
        groupSize: groupSize ?? defaultGroupSize(config.kvHeads, config.headDim),
        /** Of every quantized variant except int2-calibrated, which uses `calibration.clip` when it has one. */
        clipQuantile: 1,
        view: 'decode: the query at t reads the pages the pool has demoted when it runs as a one-token step',
      },
      queries: `positions ${firstQuery}..${ctx - 1} of each window (every query whose history holds a quantized page), every head; ${summary.samples} (query, head) samples per layer`,
      calibration,
      seconds: Math.round((performance.now() - started) / 100) / 10,
      ...summary,
    };
    if (args.flags.has('json')) process.stdout.write(`${JSON.stringify(report, null, 2)}\n`);
    else {
      process.stdout.write(
        `${modelPath}, ${windows} window(s) of ${ctx} tokens of ${textPath}; ${report.queries}; ` +
          `${(summary.quantizedFraction * 100).toFixed(1)}% of the attended positions quantized on average.\n\n` +
          fidelityMarkdown(summary, names),
      );
    }
    return 0;
  } finally {
    engine.unload();
    await source.close?.();
  }
}

/** Rotations the runtime's 'calibrated' mode would load: the model's metadata, else the digest-keyed cache. */
async function storedRotations(
  file: GgufFile,
  source: ByteSource,
  config: ModelConfig,
): Promise<{ rotations: CalibratedKv; source: string; tokens: number } | null> {
  const found = await findStoredRotations(file, source, config, nodeRotationCache());
  if (!found.rotations) return null;
  const where = found.from === 'metadata' ? 'model metadata' : `rotation cache (digest ${found.digest.slice(0, 12)})`;
  return { rotations: found.rotations, source: where, tokens: found.rotations.tokens };
}

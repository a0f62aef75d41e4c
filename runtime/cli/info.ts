import { InvalidRequestError } from '../../core/errors.ts';
import { GGML_TYPE_INFO } from '../../core/gguf-types.ts';
import { sourceFromPath } from '../gguf/node-source.ts';
import { parseGguf } from '../gguf/parse.ts';
import { readModelConfig } from '../model/config.ts';
import type { ParsedArgs } from './args.ts';

/** `longtab info FILE`: what the file is and what it will cost to run, without touching the GPU. */
export async function runInfo(args: ParsedArgs): Promise<number> {
  const path = args.positional[0];
  if (!path) throw new InvalidRequestError('Usage: longtab info FILE [--json]');
  const source = await sourceFromPath(path);
  try {
    const file = await parseGguf(source);
    const config = readModelConfig(file);
    const types: Record<string, { tensors: number; bytes: number }> = {};
    let parameters = 0;
    let weightBytes = 0;
    for (const t of file.tensors) {
      const name = GGML_TYPE_INFO[t.type]?.name ?? String(t.type);
      const entry = (types[name] ??= { tensors: 0, bytes: 0 });
      entry.tensors += 1;
      entry.bytes += t.byteLength;
      parameters += t.shape.reduce((a, b) => a * b, 1);
      weightBytes += t.byteLength;
    }
    const kvBytesPerTokenF16 = 2 * config.layers * config.kvHeads * config.headDim * 2;
    const info = {
      file: path,
      fileBytes: file.fileSize,
      ggufVersion: file.version,
      config,
      parameters,
      tensorTypes: types,
      memory: {
        weightsBytes: weightBytes,
        kvBytesPerTokenF16,
        kvBytesAtContextF16: kvBytesPerTokenF16 * config.contextLength,
      },
    };
    if (args.flags.has('json')) {
      process.stdout.write(`${JSON.stringify(info, null, 2)}\n`);
    } else {
      const mib = (b: number) => `${(b / 1048576).toFixed(1)} MiB`;
      const lines = [
        `${config.name} (${config.architecture}), ${(parameters / 1e6).toFixed(2)}M parameters, GGUF v${file.version}`,
        `  layers ${config.layers}, dim ${config.dim}, heads ${config.heads}/${config.kvHeads} kv, head_dim ${config.headDim}, ffn ${config.ffnDim}, vocab ${config.vocab}`,
        `  context ${config.contextLength}, rope ${config.ropeLayout} base ${config.ropeBase}${config.ropeScaling.type === 'none' ? '' : `, ${config.ropeScaling.type} scaling ×${config.ropeScaling.factor}`}${config.biases.length ? `, biases ${config.biases.join('/')}` : ''}${config.qkNorm ? ', qk norm' : ''}${config.tiedOutput ? ', tied output' : ''}`,
        `  tensor types: ${Object.entries(types)
          .map(([n, e]) => `${n} ×${e.tensors} (${mib(e.bytes)})`)
          .join(', ')}`,
        `  memory: weights ${mib(weightBytes)}; fp16 KV ${(kvBytesPerTokenF16 / 1024).toFixed(1)} KiB/token, ${mib(kvBytesPerTokenF16 * config.contextLength)} at ${config.contextLength} tokens`,
      ];
      process.stdout.write(`${lines.join('\n')}\n`);
    }
    return 0;
  } finally {
    await source.close?.();
  }
}

import { InvalidRequestError } from '../../core/errors.ts';
import type { GpuContext } from '../../core/gpu/device.ts';
import { parseLoadOptions } from '../engine/load-options.ts';
import { ModelRunner } from '../engine/model-runner.ts';
import { sourceFromPath } from '../gguf/node-source.ts';
import { chatTemplateFromMetadata, renderChatTemplate } from '../tokenizer/chat-template.ts';
import { numberFlag, type ParsedArgs, stringFlag } from './args.ts';
import { defaultModelPath } from './default-model.ts';

/** `longtab generate`: one prompt, streamed to stdout (or one JSON object with --json). */
export async function runGenerate(args: ParsedArgs, gpu: GpuContext): Promise<number> {
  const modelPath = stringFlag(args, 'model') ?? defaultModelPath();
  const prompt = stringFlag(args, 'prompt') ?? '';
  const json = args.flags.has('json');
  const engine = new ModelRunner(gpu);
  const source = await sourceFromPath(modelPath);
  try {
    await engine.load(source, parseLoadOptions({ kv: stringFlag(args, 'kv') }));
    const tokenizer = engine.tokenizer;
    let promptIds: number[];
    if (args.flags.has('chat')) {
      const text = renderChatTemplate(chatTemplateFromMetadata(engine.loaded!.file.metadata), {
        messages: [{ role: 'user', content: prompt }],
        add_generation_prompt: true,
        bos_token: tokenizer.bosId !== undefined ? tokenizer.tokenText(tokenizer.bosId) : '',
        eos_token: tokenizer.eosId !== undefined ? tokenizer.tokenText(tokenizer.eosId) : '',
      });
      // Templates that already write BOS (Llama 3's) must not get a second one from the tokenizer.
      const bosText = tokenizer.bosId !== undefined ? tokenizer.tokenText(tokenizer.bosId) : '';
      promptIds = tokenizer.encode(text, { addSpecial: !(bosText && text.startsWith(bosText)), parseSpecial: true });
    } else if (prompt === '') {
      if (tokenizer.bosId === undefined) throw new InvalidRequestError('This model has no BOS token: give a --prompt.');
      promptIds = [tokenizer.bosId];
    } else {
      promptIds = tokenizer.encode(prompt, { addSpecial: true });
    }
    const stream = tokenizer.createStreamDecoder({ skipSpecial: true });
    const result = await engine.generate({
      promptIds,
      maxTokens: numberFlag(args, 'max-tokens', 128),
      sampling: {
        temperature: numberFlag(args, 'temperature', 0),
        topK: numberFlag(args, 'top-k', 0),
        topP: numberFlag(args, 'top-p', 1),
        minP: numberFlag(args, 'min-p', 0),
        repetitionPenalty: numberFlag(args, 'repetition-penalty', 1),
        seed: numberFlag(args, 'seed', 0),
      },
      onToken: json
        ? undefined
        : (id) => {
            process.stdout.write(stream.push(id));
            return undefined;
          },
    });
    const text = tokenizer.decode(result.ids, { skipSpecial: true });
    if (json) {
      process.stdout.write(
        `${JSON.stringify({ ids: result.ids, text, finish_reason: result.finishReason, usage: result.usage })}\n`,
      );
    } else {
      process.stdout.write(`${stream.flush()}\n`);
      const u = result.usage;
      process.stderr.write(
        `\n[${u.promptTokens} prompt tokens, ${u.completionTokens} generated; prefill ${u.prefillTokensPerSecond.toFixed(1)} tok/s, decode ${u.decodeTokensPerSecond.toFixed(1)} tok/s, TTFT ${u.ttftMs.toFixed(1)} ms; ${gpu.adapter.description || gpu.adapter.vendor}]\n`,
      );
    }
    return 0;
  } finally {
    engine.unload();
    await source.close?.();
  }
}

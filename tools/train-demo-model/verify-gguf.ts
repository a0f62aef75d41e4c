/**
 * Checks an exported demo GGUF against llama.cpp (node-llama-cpp, CPU): its tokenizer (tokenizer.ggml.pre = gpt-2)
 * must reproduce tokenizer.py's ids exactly, and its teacher-forced loss on held-out text must match the loss that
 * train.py / inspect_attention.py measured on the f32 weights (Q8_0 moves it by ~0.01).
 *
 *   npx tsx tools/train-demo-model/verify-gguf.ts MODEL.gguf TEXT.txt TEXT_IDS.u16 HELD_OUT_IDS.u16 [tokens]
 *
 * TEXT_IDS.u16 is what tokenizer.py wrote for TEXT.txt (<|bos|> first, <|eos|> last).
 */
import { readFileSync } from 'node:fs';
import { getLlama, LlamaLogLevel } from 'node-llama-cpp';
import { LlamaReference } from '../fixtures/llama-reference.ts';

function readU16(path: string): number[] {
  const b = readFileSync(path);
  const out: number[] = [];
  for (let i = 0; i + 1 < b.length; i += 2) out.push(b.readUInt16LE(i));
  return out;
}

async function main(argv: string[]): Promise<void> {
  const [modelPath, textPath, textIdsPath, heldOutPath, tokensArg = '512'] = argv;
  if (!modelPath || !textPath || !textIdsPath || !heldOutPath) {
    console.error('usage: verify-gguf.ts MODEL.gguf TEXT.txt TEXT_IDS.u16 HELD_OUT_IDS.u16 [tokens]');
    process.exit(2);
  }
  let failed = false;
  const llama = await getLlama({ gpu: false, build: 'never', logLevel: LlamaLogLevel.error });
  const model = await llama.loadModel({ modelPath });
  const text = readFileSync(textPath, 'utf8');
  const ours = readU16(textIdsPath).slice(1, -1);
  const theirs = Array.from(model.tokenize(text, false));
  const n = Math.min(ours.length, theirs.length);
  let first = -1;
  for (let i = 0; i < n; i++) {
    if (ours[i] !== theirs[i]) {
      first = i;
      break;
    }
  }
  if (first < 0 && ours.length === theirs.length) {
    console.log(`tokenizer: llama.cpp reproduces all ${ours.length} ids of ${textPath}`);
  } else {
    failed = true;
    console.log(`tokenizer MISMATCH at ${first}: ours ${ours.length} ids, llama.cpp ${theirs.length}`);
    console.log(`  ours ${ours.slice(first, first + 8)} llama.cpp ${theirs.slice(first, first + 8)}`);
  }
  console.log(
    `bos ${model.tokens.bos} eos ${model.tokens.eos}; chat template present: ${Boolean(model.fileInfo.metadata.tokenizer.chat_template)}`,
  );
  await model.dispose();
  await llama.dispose();

  const T = Number(tokensArg);
  const ids = readU16(heldOutPath).slice(0, T + 1);
  const ref = await LlamaReference.create();
  const { vocab, logProbs } = await ref.teacherForced(modelPath, ids.slice(0, T));
  await ref.dispose();
  let nll = 0;
  for (let t = 0; t < T; t++) nll -= logProbs[t * vocab + ids[t + 1]!]!;
  console.log(`llama.cpp teacher-forced loss over the first ${T} tokens of ${heldOutPath}: ${(nll / T).toFixed(4)}`);
  if (failed) process.exit(1);
}

await main(process.argv.slice(2));

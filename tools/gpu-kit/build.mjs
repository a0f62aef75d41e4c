#!/usr/bin/env node
/**
 * `npm run bench:bundle`: everything the GPU host needs for the bench, in `.gpu/` (carried by the device tool; keep
 * `.gpu/` out of git). The host has no Node and no network: see BENCH.md for the one-call device command.
 *
 *   .gpu/kit.tar.xz        node + Dawn (webgpu) + Vulkan loader debs: ../shared/gpu/make-kit.sh (made if missing)
 *   .gpu/bench.mjs         bench/run.ts bundled into one ESM file; `webgpu` and `node-llama-cpp` stay external
 *   .gpu/profile.mjs       bench/profile-decode.ts the same way (per-kernel decode timings)
 *   .gpu/attention-kernels.mjs  bench/attention-kernels.ts (decode or prefill attention kernels side by side, one layer)
 *   .gpu/int8-dot-probe.mjs     bench/int8-dot-probe.ts (peak f32 fma against dot4I8Packed)
 *   .gpu/occupancy-probe.mjs    bench/occupancy-probe.ts (resident workgroups by workgroup memory and size)
 *   .gpu/transfer-probe.mjs     bench/transfer-probe.ts (host <-> GPU copy rates, hashing and file reads of KV pages)
 *   .gpu/demote-kernel.mjs      bench/demote-kernel.ts (the KV demotion kernel: builds checked word for word, ablations)
 *   .gpu/rotate-kernel.mjs      bench/rotate-kernel.ts (the prefill rotation by workgroup layout, checked against each other)
 *   .gpu/int8-matmul.mjs   bench/int8-matmul.ts (the tensor-core int8 matmul: its randomized checks, then its speed
 *                          against the f32 kernels)
 *   .gpu/constrained-decode.mjs  bench/constrained-decode.ts (decode TPOT under a response format ÷ plain text)
 *   .gpu/kv-resume.mjs     bench/kv-resume.ts (TTFT of a follow-up turn by where the conversation's KV is)
 *   .gpu/longtab.mjs       the longtab CLI (tools/gpu-kit/longtab-cli.ts): evaluations on the GPU host
 *   .gpu/wgsl-dump.mjs     tools/wgsl-dump/main.ts (`npm run wgsl:dump`: every pipeline the runtime compiles for a
 *                          model, on the host's device)
 *   .gpu/llama-kit.tar.xz  node_modules/node-llama-cpp (its JS bundled into one dist/index.js, plus package.json and
 *                          the llama/ metadata files it reads) and @node-llama-cpp/linux-x64-vulkan (the prebuilt
 *                          Vulkan binaries); unpacked into the kit, next to the kit's node_modules/webgpu
 *
 * Check the result here, from an unpacked copy of the kit: `sh tools/gpu-kit/check-local.sh`.
 * Uses esbuild (installed with tsx, a dependency of this project).
 */
import { execFileSync } from 'node:child_process';
import { cpSync, existsSync, mkdirSync, mkdtempSync, rmSync, statSync, symlinkSync } from 'node:fs';
import { readFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { dirname, join, relative, resolve, sep } from 'node:path';
import { fileURLToPath } from 'node:url';
import { build } from 'esbuild';

const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), '..', '..');
const OUT = join(ROOT, '.gpu');
const NM = join(ROOT, 'node_modules');
const CARRY_LIMIT = 64 * 2 ** 20;

function log(line) {
  process.stderr.write(`[gpu-kit] ${line}\n`);
}

function size(path) {
  return statSync(path).size;
}

function mib(bytes) {
  return `${(bytes / 2 ** 20).toFixed(1)} MiB`;
}

mkdirSync(OUT, { recursive: true });

// 1. node + Dawn kit (shared script; only when missing: it takes a minute and needs apt-get download).
const kit = join(OUT, 'kit.tar.xz');
if (!existsSync(kit)) {
  log('making .gpu/kit.tar.xz with ../shared/gpu/make-kit.sh');
  const makeKit = resolve(ROOT, '..', 'shared', 'gpu', 'make-kit.sh');
  execFileSync('sh', [makeKit], { cwd: ROOT, stdio: 'inherit' });
}

// 2. The bench as one ESM file, built from the last commit (HEAD exported with git archive: the shared working tree
//    may hold other people's half-made edits), or from the working tree with --worktree.
const fromWorktree = process.argv.includes('--worktree');
const commit = execFileSync('git', ['rev-parse', 'HEAD'], { cwd: ROOT, encoding: 'utf8' }).trim();
let SRC = ROOT;
let exported = null;
if (!fromWorktree) {
  exported = mkdtempSync(join(tmpdir(), 'longtab-head-'));
  execFileSync('sh', ['-c', `git archive --format=tar HEAD | tar -xf - -C "${exported}"`], { cwd: ROOT });
  symlinkSync(NM, join(exported, 'node_modules'));
  SRC = exported;
}
log(`bundling bench/run.ts from ${fromWorktree ? 'the working tree' : `HEAD ${commit.slice(0, 12)}`}`);
const nodeBuiltinsBanner =
  "import { createRequire as __longtabCreateRequire } from 'node:module'; const require = __longtabCreateRequire(import.meta.url);";
const benchBuild = (entry, outfile) =>
  build({
    entryPoints: [join(SRC, entry.includes('/') ? entry : join('bench', entry))],
    outfile: join(OUT, outfile),
    define: { 'process.env.LONGTAB_BENCH_COMMIT': JSON.stringify(fromWorktree ? `${commit}+worktree` : commit) },
    bundle: true,
    platform: 'node',
    format: 'esm',
    target: 'node20',
    external: ['webgpu', 'node-llama-cpp', '@node-llama-cpp/*'],
    banner: { js: nodeBuiltinsBanner },
    legalComments: 'none',
    logLevel: 'warning',
  });
try {
  await benchBuild('run.ts', 'bench.mjs');
  // Per-kernel decode profile (bench/profile-decode.ts): 0.2 MiB more, optional on the host.
  await benchBuild('profile-decode.ts', 'profile.mjs');
  await benchBuild('attention-kernels.ts', 'attention-kernels.mjs');
  await benchBuild('int8-dot-probe.ts', 'int8-dot-probe.mjs');
  await benchBuild('occupancy-probe.ts', 'occupancy-probe.mjs');
  await benchBuild('transfer-probe.ts', 'transfer-probe.mjs');
  await benchBuild('demote-kernel.ts', 'demote-kernel.mjs');
  await benchBuild('rotate-kernel.ts', 'rotate-kernel.mjs');
  await benchBuild('int8-matmul.ts', 'int8-matmul.mjs');
  await benchBuild('constrained-decode.ts', 'constrained-decode.mjs');
  await benchBuild('kv-resume.ts', 'kv-resume.mjs');
  await benchBuild('tools/gpu-kit/longtab-cli.ts', 'longtab.mjs');
  await benchBuild('tools/wgsl-dump/main.ts', 'wgsl-dump.mjs');
} catch {
  log(
    fromWorktree
      ? 'the working tree does not bundle (see the error above)'
      : `HEAD ${commit.slice(0, 12)} does not bundle (see the error above; a commit that misses a file?): fix HEAD, or bundle the working tree with --worktree`,
  );
  process.exitCode = 1;
} finally {
  if (exported) rmSync(exported, { recursive: true, force: true });
}
if (process.exitCode) process.exit();
log(`.gpu/bench.mjs ${mib(size(join(OUT, 'bench.mjs')))}, .gpu/profile.mjs ${mib(size(join(OUT, 'profile.mjs')))}`);

/**
 * node-llama-cpp finds its files from each module's own location (`dist/utils/x.js` reads `../../package.json`,
 * `dist/config.js` reads `../llama`). In one bundle at dist/index.js every module would share one location, so each
 * module's `import.meta.url` is rewritten to the URL its file had (relative to the bundle). Not in testBindingBinary.js:
 * it forks its own file to test the binary, which must be the bundle (it runs the test when TEST_BINDING_CP is set).
 */
function keepModuleLocations(distDir) {
  return {
    name: 'keep-module-locations',
    setup(b) {
      b.onLoad({ filter: /\.js$/ }, async (args) => {
        const rel = relative(distDir, args.path);
        if (rel.startsWith('..') || rel.endsWith('testBindingBinary.js')) return undefined;
        const source = await readFile(args.path, 'utf8');
        if (!source.includes('import.meta.url')) return undefined;
        const url = `new URL(${JSON.stringify(rel.split(sep).join('/'))}, import.meta.url).href`;
        return { contents: source.replaceAll('import.meta.url', url), loader: 'js', resolveDir: dirname(args.path) };
      });
    },
  };
}

// 3. node-llama-cpp: its JS as one file, in its own package folder so the paths it computes from import.meta.url
//    (../llama, ../package.json) and its binary self-test (it forks its own file) still work.
// Rebuilt only when node-llama-cpp or this script changed (xz takes minutes on 2 cores); --force rebuilds it.
const llamaKit = join(OUT, 'llama-kit.tar.xz');
const llamaKitFresh =
  !process.argv.includes('--force') &&
  existsSync(llamaKit) &&
  statSync(llamaKit).mtimeMs > statSync(join(NM, 'node-llama-cpp', 'package.json')).mtimeMs &&
  statSync(llamaKit).mtimeMs > statSync(fileURLToPath(import.meta.url)).mtimeMs;
if (llamaKitFresh) log('.gpu/llama-kit.tar.xz is up to date');
else await packLlamaKit();

async function packLlamaKit() {
  const stage = mkdtempSync(join(tmpdir(), 'longtab-llama-kit-'));
  try {
    const nlc = join(NM, 'node-llama-cpp');
    const target = join(stage, 'node_modules', 'node-llama-cpp');
    mkdirSync(join(target, 'dist'), { recursive: true });
    await build({
      entryPoints: [join(nlc, 'dist', 'index.js')],
      outfile: join(target, 'dist', 'index.js'),
      bundle: true,
      platform: 'node',
      format: 'esm',
      target: 'node20',
      // Prebuilt binaries are found by importing their package (its getBinsDir() points next to itself).
      // @reflink: ipull's copy-on-write file cloning for downloads (a native .node, imported lazily): never reached.
      external: ['@node-llama-cpp/*', '@reflink/*'],
      plugins: [keepModuleLocations(join(nlc, 'dist'))],
      banner: { js: nodeBuiltinsBanner },
      legalComments: 'none',
      logLevel: 'error',
    });
    cpSync(join(nlc, 'package.json'), join(target, 'package.json'));
    cpSync(join(nlc, 'LICENSE'), join(target, 'LICENSE'));
    mkdirSync(join(target, 'llama'), { recursive: true });
    for (const file of ['binariesGithubRelease.json', 'llama.cpp.info.json', 'package.json']) {
      if (existsSync(join(nlc, 'llama', file))) cpSync(join(nlc, 'llama', file), join(target, 'llama', file));
    }
    for (const name of ['linux-x64-vulkan']) {
      const from = join(NM, '@node-llama-cpp', name);
      if (!existsSync(join(from, 'package.json'))) {
        throw new Error(
          `node_modules/@node-llama-cpp/${name} is missing: it is an optional dependency of node-llama-cpp (npm i -E -D @node-llama-cpp/${name}@3.21.1).`,
        );
      }
      cpSync(from, join(stage, 'node_modules', '@node-llama-cpp', name), { recursive: true });
    }
    const tarball = llamaKit;
    execFileSync('sh', ['-c', `tar -C "${stage}" -cf - node_modules | xz -6 -T2 > "${tarball}"`], { stdio: 'inherit' });
    log(`.gpu/llama-kit.tar.xz ${mib(size(tarball))}`);
  } finally {
    rmSync(stage, { recursive: true, force: true });
  }
}

// 4. What the device tool carries (these three files; other files in .gpu/ are not needed).
const carried = ['kit.tar.xz', 'bench.mjs', 'llama-kit.tar.xz', 'profile.mjs'];
const total = carried.reduce((sum, f) => sum + size(join(OUT, f)), 0);
log(`carry: ${carried.map((f) => `.gpu/${f}`).join(' + ')} = ${mib(total)} (limit ${mib(CARRY_LIMIT)})`);
if (total > CARRY_LIMIT) {
  log('over the carry limit');
  process.exitCode = 1;
}

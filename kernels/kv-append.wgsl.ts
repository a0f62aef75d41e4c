/** The KvStep uniform's layout (runtime/kv/pool.ts writes it before each submit). */
export const KV_STEP_WGSL = 'struct KvStep { position: u32, tokens: u32, tableOffset: u32, length: u32 }';

/**
 * The four slabs as `array<vec4<u32>>` (read-only) and `fn name(entry, first, count, lid, to)`: the workgroup copies
 * vec4 words first..first+count of the page `entry` (in vec4 units) into `target[to..to+count)`, count <= maxCount.
 * One uniform branch per call and a constant-trip loop, so the loads are independent and in flight together.
 */
export function kvTileLoaderWgsl(
  names: readonly { name: string; target: string }[],
  firstBinding: number,
  wgSize: number,
  maxCount: number,
): string {
  const loaders = names.map(({ name, target }) => {
    const cases = [0, 1, 2, 3]
      .map(
        (i) =>
          `    ${i === 3 ? 'default' : `case ${i}u`}: {
      for (var k = 0u; k < ${Math.ceil(maxCount / wgSize)}u; k++) {
        let i = lid + k * ${wgSize}u;
        if (i < count) { ${target}[to + i] = slab${i}[base + i]; }
      }
    }`,
      )
      .join('\n');
    return `fn ${name}(entry: u32, first: u32, count: u32, lid: u32, to: u32) {
  let base = (entry & 0xffffffu) * (params.pageWords / 4u) + first;
  switch ((entry >> 24u) & 0xfu) {
${cases}
  }
}`;
  });
  return `${kvPagesReadableWgsl(firstBinding)}
${loaders.join('\n')}`;
}

/**
 * The KvStep uniform, the four slabs as `array<vec4<u32>>` (read-only) and `slabQuad(slot, i)` / `slabWord(slot, i)`:
 * vec4 i, or u32 word i, of slab `slot` (bits 24..27 of a page-table entry).
 */
export function kvPagesReadableWgsl(firstBinding: number): string {
  const slabs = [0, 1, 2, 3]
    .map((i) => `@group(0) @binding(${firstBinding + i}) var<storage, read> slab${i}: array<vec4<u32>>;`)
    .join('\n');
  return `${KV_STEP_WGSL}
${slabs}
fn slabQuad(slot: u32, i: u32) -> vec4<u32> {
  var w: vec4<u32>;
  if (slot == 0u) { w = slab0[i]; } else if (slot == 1u) { w = slab1[i]; } else if (slot == 2u) { w = slab2[i]; } else { w = slab3[i]; }
  return w;
}
fn slabWord(slot: u32, i: u32) -> u32 { return slabQuad(slot, i / 4u)[i % 4u]; }`;
}

/**
 * `kvStore(entry, word, value)`: writes one u32 (two halves) of the page named by a page-table entry
 * (kind << 28 | slab << 24 | page); needs read_write `slab0..3` and `params.pageWords` in scope (runtime/kv/pool.ts has
 * the page layout).
 */
export const kvStoreWgsl = /* wgsl */ `
fn kvStore(entry: u32, word: u32, value: u32) {
  let index = (entry & 0xffffffu) * params.pageWords + word;
  switch ((entry >> 24u) & 0xfu) {
    case 0u: { slab0[index] = value; }
    case 1u: { slab1[index] = value; }
    case 2u: { slab2[index] = value; }
    default: { slab3[index] = value; }
  }
}
`;

/**
 * Writes the step's K and V rows (f32 [tokens, kvHeads*headDim]) into their pages as packed f16.
 * One invocation per (token, kv head, dim pair); invocations past step.tokens do nothing.
 */
export const kvAppendWgsl =
  KV_STEP_WGSL +
  /* wgsl */ `
struct Params { kOffset: u32, vOffset: u32, pageWords: u32, pageTokens: u32, kvHeads: u32, headPairs: u32, maxTokens: u32, _pad: u32 }

@group(0) @binding(0) var<storage, read> k: array<f32>;
@group(0) @binding(1) var<storage, read> v: array<f32>;
@group(0) @binding(2) var<storage, read> pageTable: array<u32>;
@group(0) @binding(3) var<uniform> step: KvStep;
@group(0) @binding(4) var<uniform> params: Params;
@group(0) @binding(5) var<storage, read_write> slab0: array<u32>;
@group(0) @binding(6) var<storage, read_write> slab1: array<u32>;
@group(0) @binding(7) var<storage, read_write> slab2: array<u32>;
@group(0) @binding(8) var<storage, read_write> slab3: array<u32>;

${kvStoreWgsl}
@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
  let i = (wg.y * groups.x + wg.x) * 64u + lid;
  let perToken = params.kvHeads * params.headPairs;
  let t = i / perToken;
  if (t >= step.tokens || t >= params.maxTokens) { return; }
  let rest = i % perToken;
  let head = rest / params.headPairs;
  let pair = rest % params.headPairs;
  let pos = step.position + t;
  let entry = pageTable[step.tableOffset + pos / params.pageTokens];
  let within = (head * params.pageTokens + pos % params.pageTokens) * params.headPairs + pair;
  let src = t * perToken * 2u + rest * 2u;
  kvStore(entry, params.kOffset + within, pack2x16float(vec2<f32>(k[src], k[src + 1u])));
  kvStore(entry, params.vOffset + within, pack2x16float(vec2<f32>(v[src], v[src + 1u])));
}
`;

/** sameVersion: one file's version told apart from another's across compressed and uncompressed answers. */
import { describe, expect, it } from 'vitest';
import { sameVersion } from './remote-file.ts';

const headers = (h: Record<string, string>) => new Headers(h);

describe('sameVersion', () => {
  const first = { etag: '"5f1-abc"', lastModified: 'Mon, 07 Dec 2026 08:00:00 GMT' };

  it('matches the ETag a compressed answer weakens (nginx) or suffixes (Apache mod_deflate)', () => {
    expect(sameVersion(first, headers({ ETag: '"5f1-abc"' }))).toBe(true);
    expect(sameVersion(first, headers({ ETag: 'W/"5f1-abc"' }))).toBe(true);
    expect(sameVersion(first, headers({ ETag: '"5f1-abc-gzip"' }))).toBe(true);
    expect(sameVersion({ ...first, etag: 'W/"5f1-abc"' }, headers({ ETag: '"5f1-abc"' }))).toBe(true);
  });

  it('tells a changed file by its ETag, else by its Last-Modified; without either it cannot', () => {
    expect(sameVersion(first, headers({ ETag: '"5f1-abd"' }))).toBe(false);
    expect(sameVersion(first, headers({ ETag: 'W/"5f2-abc"' }))).toBe(false);
    const noEtag = { etag: null, lastModified: first.lastModified };
    expect(sameVersion(noEtag, headers({ 'Last-Modified': first.lastModified }))).toBe(true);
    expect(sameVersion(noEtag, headers({ 'Last-Modified': 'Tue, 08 Dec 2026 08:00:00 GMT' }))).toBe(false);
    expect(sameVersion({ etag: null, lastModified: null }, headers({}))).toBe(true);
  });
});

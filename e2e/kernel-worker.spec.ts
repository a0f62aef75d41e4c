import { expect, test } from '@playwright/test';

test('kernels in a module worker match their CPU references', async ({ page }, testInfo) => {
  const pageErrors: string[] = [];
  page.on('pageerror', (error) => pageErrors.push(error.message));
  page.on('console', (message) => {
    if (message.type() === 'error') pageErrors.push(`console: ${message.text()}`);
  });

  await page.goto('/e2e/harness/kernels.html');
  await page.waitForFunction(() => window.kernelReport !== undefined, undefined, { timeout: 90_000 });
  const report = await page.evaluate(() => window.kernelReport!);

  await testInfo.attach('kernel-report.json', {
    body: JSON.stringify(report, null, 2),
    contentType: 'application/json',
  });
  const screenshot = testInfo.outputPath('kernel-harness.png');
  await page.screenshot({ path: screenshot, fullPage: true });
  await testInfo.attach('kernel-harness', { path: screenshot, contentType: 'image/png' });

  if (!report.ok) throw new Error(`the kernel worker failed: ${report.error}`);
  const { adapter } = report;
  console.log(
    `adapter: ${adapter.vendor}/${adapter.architecture}/${adapter.description} fallback=${adapter.isFallbackAdapter}; ` +
      `features ${JSON.stringify(report.features)}; maxBufferSize ${report.limits.maxBufferSize}`,
  );
  expect(report.limits.maxStorageBufferBindingSize, 'adapter limits').toBeGreaterThan(0);

  // The harness must have run the kernel and its broken twin; an empty check list is not a pass.
  const names = report.checks.map((c) => c.name);
  expect(names).toContain('rmsnorm 3x255');
  expect(report.checks.some((c) => c.name.startsWith('rmsnorm') && c.expect === 'mismatch')).toBe(true);

  for (const c of report.checks) {
    expect.soft(c.error, `${c.name} threw`).toBeUndefined();
    expect.soft(c.elements, `${c.name} compared no values`).toBeGreaterThan(0);
    if (c.expect === 'match') {
      expect.soft(c.maxToleranceRatio, `${c.name}: max error / tolerance`).toBeLessThanOrEqual(1);
    } else {
      expect.soft(c.maxToleranceRatio, `${c.name}: the broken kernel must be caught`).toBeGreaterThan(1);
    }
    expect.soft(c.leakedBuffers, `${c.name} leaked buffers`).toBe(0);
    expect.soft(c.uncapturedErrors, `${c.name} raised WebGPU errors`).toEqual([]);
  }
  expect(report.uncapturedErrors, 'uncaptured WebGPU errors').toEqual([]);
  expect(report.allocator.totalBuffers, 'live buffers after the run').toBe(0);
  expect(report.allocator.totalBytes, 'live bytes after the run').toBe(0);
  expect(pageErrors).toEqual([]);
});

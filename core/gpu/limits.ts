/** The adapter limits longtab asks for: always the adapter's real values, never the spec defaults. */
export const REQUESTED_LIMITS = [
  'maxBufferSize',
  'maxStorageBufferBindingSize',
  'maxComputeWorkgroupStorageSize',
  'maxStorageBuffersPerShaderStage',
  'maxComputeInvocationsPerWorkgroup',
  'maxComputeWorkgroupSizeX',
  'maxComputeWorkgroupSizeY',
  'maxComputeWorkgroupSizeZ',
  'maxComputeWorkgroupsPerDimension',
  'maxUniformBufferBindingSize',
  'maxBindGroups',
] as const;

type RequestedLimit = (typeof REQUESTED_LIMITS)[number];
export type GpuLimits = Record<RequestedLimit, number>;

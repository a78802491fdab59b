/*
 * The DLPack ABI that ONNX Runtime 1.19.2 and PyTorch exchange tensors through: the stable, unversioned
 * v0.x layout of dlpack.h (DLManagedTensor, capsule name "dltensor"). One copy, included by
 * bridge/_aten.c (the ATen executor) and kernels/_cpu.c (the CPU kernels it calls).
 */
#ifndef ORTWRAP_DLPACK_H
#define ORTWRAP_DLPACK_H

#include <stdint.h>

typedef struct {
  int32_t device_type; /* DLDeviceType enum, int-sized */
  int32_t device_id;
} DLDevice;
typedef struct {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
} DLDataType;
typedef struct {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
} DLTensor;
typedef struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(struct DLManagedTensor* self);
} DLManagedTensor;

enum { kDLCPU = 1, kDLInt = 0, kDLFloat = 2, kDLBfloat = 4 };

#endif /* ORTWRAP_DLPACK_H */
